"""Sampling text from the trained model, byte by byte (no KV cache: the model is tiny).

Each prompt becomes [BOS] + its bytes; every step runs the model on the last seq_len tokens
(one document, so is_seq_start flags only the first), takes the last position's logits over the
real vocabulary (ids >= VOCAB_SIZE are padding and never sampled, nor is BOS), divides them by
the temperature and draws from a generator seeded per prompt.

Under a mesh every rank runs the same rows (the forward is collective) and the token drawn on
global rank 0 is broadcast: ranks along e may see last-bit differences in the expert GEMMs, and
one different draw would desynchronise the collectives of the next step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardmoe.model.transformer import Transformer
from shardmoe.train.data import BOS, VOCAB_SIZE, decode, encode

DEFAULT_PROMPTS = ("In the beginning", "And the LORD said unto Moses,", "And it came to pass")


@torch.no_grad()
def sample(model: Transformer, prompt: str, num_bytes: int, *, seq_len: int, temperature: float = 0.8,
           seed: int = 0, stop_at_newline: bool = True) -> str:
    """The prompt followed by up to num_bytes sampled bytes (stopping after a newline if asked)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.tensor([BOS]), encode(prompt)])
    start = ids.numel()
    for _ in range(num_bytes):
        window = ids[-seq_len:].view(1, -1)
        is_seq_start = torch.zeros_like(window, dtype=torch.bool)
        is_seq_start[:, 0] = True
        logits = model.logits(window, is_seq_start)[0, -1, :VOCAB_SIZE].double()
        logits[BOS] = float("-inf")
        probs = torch.softmax(logits / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)
        if dist.is_available() and dist.is_initialized():
            dist.broadcast(token, src=0)
        ids = torch.cat([ids, token])
        if stop_at_newline and token.item() == ord("\n"):
            break
    return prompt + decode(ids[start:])
