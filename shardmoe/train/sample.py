"""Sampling text from a trained model, token by token, with a KV cache.

The prompt's ids follow BOS. The model sees one document, the tokens of its window: the ids from
the window's start (is_seq_start flags only that first one, so positions restart there). The
window starts at the first of the last seq_len ids of the prompt, and when it would pass seq_len
tokens it restarts at the last seq_len // 2 (window_start): the model never sees more than it
was trained on. Each new token is drawn from the last position's logits over the tokenizer's ids
(BOS and the padding ids above them are never drawn): the top_k largest (0: all), softmax((logits
- max) / temperature), one draw from `generator` or from torch's global CPU generator when it is
None. Subtracting the max first keeps any positive finite temperature exact: a tiny one leaves
the largest logit alone at probability 1 instead of inf / inf. The draw happens on the CPU from
float64 probabilities, whatever device the model computes on.

KV cache (a Transformer holding the whole model): the window's tokens run through the model once
(Transformer.decode, filling each block's KVCache) and every new token runs alone against the
cache, so a token costs time linear in the window; a restart runs the kept half-window again.
`cache=False` recomputes the whole window for every token (a Pipeline's logits, the reference
the cache is checked against: the same tokens for the same draws, tests/train/test_sample.py).
With a capacity_factor the cached model routes each new token in a forward of its own, so its
drops can differ from those of the window's forward.

Training's samples (every sample_every steps and at the last step) continue PROMPTS prompts, the
first prompt_length(seq_len) tokens of the first held-out documents, and draw from the global
generator, whose state a checkpoint saves and a resume restores: a resumed run samples what the
uninterrupted one would. Rank 0 appends them to DIR/samples.jsonl, one row per prompt:
{"step", "prompt", "sample"} (the continuation alone).

Under a mesh every rank runs the same rows (the forward is collective; on a pipelined mesh `model`
is the training's Pipeline, whose logits are the last stage's, broadcast to every rank), draws (so
every rank's generator moves alike) and keeps global rank 0's token (broadcast): ranks along e may see
last-bit differences in the expert GEMMs, and one different token would desynchronise the
collectives of the next step.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardmoe.model.transformer import Transformer
from shardmoe.train.metrics import read_rows, write_rows
from shardmoe.train.tokenizer import Tokenizer

SAMPLES_FILE = "samples.jsonl"
PROMPTS = 3


def prompt_length(seq_len: int) -> int:
    """Tokens of a held-out document that make a training sample's prompt: half a row, at most 32."""
    return max(1, min(32, seq_len // 2))


def window_start(start: int | None, length: int, seq_len: int) -> int:
    """Where the window of a document of `length` ids starts, given where it started so far (None
    for a prompt): at the last seq_len ids of a prompt; unchanged while it holds at most seq_len
    ids; at the last seq_len // 2 (at least one) once it grows past seq_len."""
    if start is None:
        return max(0, length - seq_len)
    return start if length - start <= seq_len else length - max(1, seq_len // 2)


@torch.no_grad()
def sample(model: Transformer, prompt, max_tokens: int, *, tokenizer: Tokenizer, seq_len: int,
           temperature: float = 0.8, top_k: int = 0, generator: torch.Generator | None = None,
           cache: bool = True) -> np.ndarray:
    """Up to max_tokens ids drawn after the prompt's ids (see the module doc); the new ids only.
    cache: decode with a KV cache (a Transformer; a Pipeline always recomputes)."""
    ids = [tokenizer.bos, *np.asarray(prompt, dtype=np.int64).tolist()]
    start, first = None, len(ids)
    cached = cache and isinstance(model, Transformer)
    caches = None
    for _ in range(max_tokens):
        begin = window_start(start, len(ids), seq_len)
        if cached and begin == start:  # the window goes on: only the newest token runs
            logits = model.decode(_on(model, ids[-1:]), caches)[0, -1]
        elif cached:  # a new window: its tokens fill fresh caches
            caches = model.new_caches(seq_len)
            logits = model.decode(_on(model, ids[begin:]), caches)[0, -1]
        else:
            window = _on(model, ids[begin:])
            is_seq_start = torch.zeros_like(window, dtype=torch.bool)
            is_seq_start[:, 0] = True
            logits = model.logits(window, is_seq_start)[0, -1]
        start = begin
        ids.append(draw(logits[:tokenizer.vocab_size], tokenizer.bos, temperature, top_k, generator))
    return np.asarray(ids[first:], dtype=np.int64)


def _on(model, ids: list[int]) -> torch.Tensor:
    """ids as a [1 n] tensor on the model's device."""
    return torch.tensor([ids], dtype=torch.int64, device=model.device)


def draw(logits: torch.Tensor, bos: int, temperature: float, top_k: int, generator: torch.Generator | None) -> int:
    """One token id from next-token logits [V] (module doc), drawn on the CPU; under a process group
    global rank 0's draw, broadcast."""
    logits = logits.double().cpu()
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("sample: the model's next-token logits are not finite")
    logits[bos] = float("-inf")
    if 0 < top_k < logits.numel() - 1:
        logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    token = torch.multinomial(probs, 1, generator=generator)
    if dist.is_available() and dist.is_initialized():
        token = _broadcast(token)
    return int(token)


def _broadcast(token: torch.Tensor) -> torch.Tensor:
    """Global rank 0's token, on a tensor of the device the process group's backend carries."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    token = token.to(device)
    dist.broadcast(token, src=0)
    return token.cpu()


def samples_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / SAMPLES_FILE


class SampleLog:
    """Appends rounds of sample rows to DIR/samples.jsonl (one os.write per round)."""

    def __init__(self, out_dir: str | Path):
        self._fd = os.open(samples_path(out_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, rows: list[dict]) -> None:
        os.write(self._fd, "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8"))

    def close(self) -> None:
        os.close(self._fd)


def read_samples(out_dir: str | Path, up_to: int) -> list[dict]:
    """The rows of DIR/samples.jsonl with step <= up_to (metrics.read_rows: [] without the file, a
    torn last line dropped with a warning, any other unparsable line a ValueError naming it)."""
    return read_rows(samples_path(out_dir), up_to)


def write_samples(out_dir: str | Path, rows: list[dict]) -> None:
    """Replace DIR/samples.jsonl with `rows` (metrics.write_rows)."""
    write_rows(samples_path(out_dir), rows)
