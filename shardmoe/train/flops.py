"""Model FLOPs per token and a measured peak, for the MFU estimate of the progress bar.

Model FLOPs (matmul multiply-adds x 2) per token of one forward, with the implemented attention
(every query scores all L keys; the mask is applied afterwards, so causality saves nothing here):
    attention projections   2 M (Q K D) [q] + 2 M (2 K D) [k, v] + 2 (Q K D) M [o]
    scores and P.v          2 L (Q K D) + 2 L (Q K D)
    router                  2 M E
    experts (k per token)   k (2 M 2F + 2 F M)
    shared expert           2 M 2Fs + 2 Fs M (+ 2 M for its gate)
    unembedding             2 M V
A training step counts 3x the forward (the backward does two matmuls per forward matmul). The
backward's recomputations (logits, attention probabilities) are hardware FLOPs, not model FLOPs,
so they do not count, as in the PaLM definition of MFU.

Peak: there is no spec sheet for a shared CPU, so the peak is measured at start-up as the best
of a few fp32 (or float64) 1024 x 1024 matmuls, on the threads this process has. On a contended
machine that figure already reflects the contention, so MFU reads as "fraction of the matmul speed
available right now".
"""
from __future__ import annotations

import time

import torch

from shardmoe.model.transformer import TransformerConfig


def forward_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Model FLOPs of one forward pass per token (see the module docstring)."""
    moe = config.moe
    M, K, D, E, F = config.d_model, config.n_kv_heads, config.head_dim, moe.num_experts, moe.ffn_size
    heads = config.n_q_heads * D
    per_layer = (2 * M * heads + 2 * M * 2 * K * D + 2 * heads * M
                 + 4 * seq_len * heads
                 + 2 * M * E + moe.top_k * (2 * M * 2 * F + 2 * F * M)
                 + 6 * M * moe.shared_ffn_size + (2 * M if moe.shared_gate else 0))
    return config.n_layers * per_layer + 2 * M * config.vocab_size


def train_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    return 3 * forward_flops_per_token(config, seq_len)


def measure_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 10) -> float:
    """Best FLOP/s of `repeats` size x size matmuls in `dtype` (after one warm-up)."""
    a = torch.randn(size, size, dtype=dtype, generator=torch.Generator().manual_seed(0))
    a @ a
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best
