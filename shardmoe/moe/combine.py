"""Dispatch and combine between token order [S, ...] and expert-sorted rows [N, ...],
and the three backward stages that live on the combine side.

A row r of the dispatched matrix is the kept pair row_pair[r] = t * k + j. Combining
scatters rows into a [S*k, H] buffer at their pair index and sums each token's k slots:
deterministic (no atomics, no order-dependent index_add) and exact for dropped pairs,
whose slots stay zero.

CUDA tensors go to the Triton kernels of shardmoe/kernels when kernels.available() says so.

Backward stages (design.md section 4):
  1 grad_combine:        ge_r = w_r g_t(r)                       [N, H]
  2 grad_gate_combine:   dw_r = g_t(r) . y_r   (dot over H)      [N]
  5 grad_input_combine:  dx_t = sum over kept pairs of dx_r      [S, H]
"""
from __future__ import annotations

import torch

from shardmoe import kernels
from shardmoe.moe.routing import accumulation_dtype


def combine_rows(rows: torch.Tensor, row_pair: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Sum rows [N, D] back to tokens: out_t = sum of the rows whose pair belongs to t.

    Accumulates in the accumulation dtype (float32 for bf16); returns [S, D] in it.
    """
    acc = accumulation_dtype(rows.dtype)
    slots = rows.new_zeros((num_tokens * top_k, rows.shape[-1]), dtype=acc)
    slots[row_pair] = rows.to(acc)
    return slots.view(num_tokens, top_k, rows.shape[-1]).sum(1)


def combine(expert_out: torch.Tensor, weight_rows: torch.Tensor, row_pair: torch.Tensor,
            num_tokens: int, top_k: int) -> torch.Tensor:
    """Forward combine: out_t = sum_j w_tj y_j(x_t) over kept pairs. Returns [S, H], acc dtype.

    w stays in the acc dtype, so w * y is formed exactly (bf16 * fp32 promotes) before the sum."""
    if kernels.available(expert_out):
        from shardmoe.kernels import combine as triton_combine
        return triton_combine.combine(expert_out, weight_rows, row_pair, num_tokens, top_k)
    acc = accumulation_dtype(expert_out.dtype)
    return combine_rows(expert_out * weight_rows.to(acc)[:, None], row_pair, num_tokens, top_k)


def grad_combine(grad_rows: torch.Tensor, weight_rows: torch.Tensor) -> torch.Tensor:
    """Stage 1: ge_r = w_r g_r, the gradient each kept pair's expert receives. [N, D] -> [N, D].

    The product is formed in w's acc dtype and written to grad_rows' dtype: one rounding for bf16."""
    if kernels.available(grad_rows):
        from shardmoe.kernels import combine as triton_combine
        return triton_combine.grad_combine(grad_rows, weight_rows)
    return torch.mul(grad_rows, weight_rows[:, None], out=torch.empty_like(grad_rows))


def grad_gate_combine(grad_rows: torch.Tensor, out_rows: torch.Tensor) -> torch.Tensor:
    """Stage 2: dw_r = sum_d grad_rows[r, d] * out_rows[r, d], accumulated in the acc dtype. -> [N]

    With (g, y) this is dL/dw for the pair. Any factorisation of the same dot works:
    the glu expert passes (g Wdown, a), since g . (a Wdown^T) = (g Wdown) . a, so y is never saved.
    """
    if kernels.available(grad_rows):
        from shardmoe.kernels import combine as triton_combine
        return triton_combine.grad_gate_combine(grad_rows, out_rows)
    # Products are formed in the acc dtype too: rounding each one to bf16 before the sum costs
    # more accuracy than the routing gradient's cancellations can afford.
    return (grad_rows.to(accumulation_dtype(grad_rows.dtype)) * out_rows).sum(-1)


def grad_input_combine(dx_rows: torch.Tensor, row_pair: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Stage 5: dx_t = sum over kept pairs of t of dx_r. No probability scaling: grad_combine
    already applied w. [N, H] -> [S, H] in the acc dtype."""
    if kernels.available(dx_rows):
        from shardmoe.kernels import combine as triton_combine
        return triton_combine.grad_input_combine(dx_rows, row_pair, num_tokens, top_k)
    return combine_rows(dx_rows, row_pair, num_tokens, top_k)
