"""Sampling text from a trained model, token by token (no KV cache: the models here are tiny).

The prompt's ids follow BOS; every step runs the model on the last seq_len tokens (one document,
so is_seq_start flags only the first), takes the last position's logits over the tokenizer's ids
(BOS and the padding ids above them are never drawn), keeps the top_k largest (0: all), and draws
one token from softmax((logits - max) / temperature): from `generator`, or from torch's global
generator when it is None. Subtracting the max first keeps any positive finite temperature exact:
a tiny one leaves the largest logit alone at probability 1 instead of inf / inf.

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


@torch.no_grad()
def sample(model: Transformer, prompt, max_tokens: int, *, tokenizer: Tokenizer, seq_len: int,
           temperature: float = 0.8, top_k: int = 0, generator: torch.Generator | None = None) -> np.ndarray:
    """Up to max_tokens ids drawn after the prompt's ids (see the module doc); the new ids only."""
    ids = torch.cat([torch.tensor([tokenizer.bos]), torch.as_tensor(np.asarray(prompt, dtype=np.int64))])
    start = ids.numel()
    for _ in range(max_tokens):
        window = ids[-seq_len:].view(1, -1)
        is_seq_start = torch.zeros_like(window, dtype=torch.bool)
        is_seq_start[:, 0] = True
        logits = model.logits(window, is_seq_start)[0, -1, :tokenizer.vocab_size].double()
        if not bool(torch.isfinite(logits).all()):
            raise ValueError("sample: the model's next-token logits are not finite")
        logits[tokenizer.bos] = float("-inf")
        if 0 < top_k < tokenizer.vocab_size - 1:
            logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
        probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)
        if dist.is_available() and dist.is_initialized():
            dist.broadcast(token, src=0)
        ids = torch.cat([ids, token])
    return ids[start:].numpy()


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
