"""Dispatch and combine between token order [S, ...] and expert-sorted rows [N, ...],
and the three backward stages that live on the combine side.

A row r of the dispatched matrix is the kept pair row_pair[r] = t * k + j. Combining adds
each row to its token t = row_pair[r] // k (in row order, so deterministic); dropped pairs
have no row and add nothing.

These functions are TorchOps' combine-side stages (moe/experts.py; TritonOps has its own on the
kernels). Of the six backward stages (docs/architecture.md), three live here:
  1 grad_combine:        ge_r = w_r g_t(r)                       [N, H]
  2 grad_gate_combine:   dw_r = g_t(r) . y_r   (dot over H)      [N]
  5 grad_input_combine:  dx_t = sum over kept pairs of dx_r      [S, H]
The stages take `ops`, the row primitives they run on (moe/experts.py TorchOps, or on CPU
moe/cpu.py CpuOps with its C++ passes); scale_rows, rowwise_dot and combine_rows below are torch's
own versions of three of those primitives.
"""
from __future__ import annotations

import torch

from shardmoe.rows import accumulation_dtype


# Row chunks whose float32 temporaries stay in cache (_CHUNK_BYTES each). Forming a bf16 product
# in fp32 over a whole [N, F] tensor writes fresh 4-byte-per-element buffers and takes mixed-dtype
# slow paths; chunk by chunk the same math stays in cache.
_CHUNK_BYTES = 1 << 20


def row_chunks(rows: torch.Tensor) -> list[slice]:
    """Slices of about 1 MiB of float32 rows of `rows` [N, D] on a CPU; one slice on a GPU, where
    each chunk would be a kernel launch and there is no per-core cache to stay in."""
    if rows.device.type != "cpu":
        return [slice(None)]
    step = max(1, _CHUNK_BYTES // (4 * max(rows.shape[-1], 1)))
    return [slice(i, i + step) for i in range(0, rows.shape[0], step)]


def scale_rows(rows: torch.Tensor, weight_rows: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows_r * w_r, formed in the acc dtype and rounded once to rows' dtype (into `out` when given,
    e.g. a workspace buffer). [N, D], [N] -> [N, D]."""
    acc = accumulation_dtype(rows.dtype)
    weight = weight_rows.to(acc)[:, None]
    if rows.dtype == acc:
        return torch.mul(rows, weight, out=out) if out is not None else rows * weight
    out = torch.empty_like(rows) if out is None else out
    for c in row_chunks(rows):
        out[c] = rows[c].to(acc, copy=True).mul_(weight[c])
    return out


def rowwise_dot(rows: torch.Tensor, *factors: torch.Tensor) -> torch.Tensor:
    """sum_d rows[r, d] * prod_i factors_i[r, d], every product and the sum in the acc dtype.
    [N, D], ... -> [N]. On CPU chunked for every dtype (row_chunks): the product never exists at full
    size; on a GPU one chunk, a transient [N, D] acc-dtype product."""
    acc = accumulation_dtype(rows.dtype)
    out = rows.new_empty(rows.shape[0], dtype=acc)
    for c in row_chunks(rows):
        product = rows[c].to(acc, copy=True)
        for f in factors:
            product.mul_(f[c].to(acc))  # mixed-dtype in-place ops take a slow path
        out[c] = product.sum(-1)
    return out


def combine_rows(rows: torch.Tensor, row_pair: torch.Tensor, num_tokens: int, top_k: int,
                 weight_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Sum rows [N, D] (each scaled by w_r when weight_rows is given) back to tokens:
    out_t = sum of the rows whose pair belongs to t. Accumulates and returns [S, D] in the acc dtype.

    index_add_ on CPU adds a token's rows in row order, so the sum is deterministic."""
    row_token = torch.div(row_pair, top_k, rounding_mode="floor")
    acc = accumulation_dtype(rows.dtype)
    out = rows.new_zeros((num_tokens, rows.shape[-1]), dtype=acc)
    for c in row_chunks(rows):
        part = rows[c].to(acc)  # may alias rows (same dtype): never modify it in place
        out.index_add_(0, row_token[c], part if weight_rows is None else part * weight_rows[c, None].to(acc))
    return out


def token_rows(row_pair: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """The inverse of row_pair [N]: [S, k] int64, the rows of token t's kept pairs in ascending
    order, -1 (first) for its dropped pairs."""
    pair_row = torch.full((num_tokens * top_k,), -1, dtype=torch.int64, device=row_pair.device)
    pair_row[row_pair] = torch.arange(row_pair.numel(), device=row_pair.device)
    return pair_row.view(num_tokens, top_k).sort(dim=1).values


def combine(ops, expert_out: torch.Tensor, weight_rows: torch.Tensor, row_pair: torch.Tensor,
            num_tokens: int, top_k: int) -> torch.Tensor:
    """Forward combine: out_t = sum_j w_tj y_j(x_t) over kept pairs, w * y formed in the acc dtype.
    Returns [S, H] in the acc dtype."""
    return ops.combine_rows(expert_out, row_pair, num_tokens, top_k, weight_rows)


def grad_combine(ops, grad_rows: torch.Tensor, weight_rows: torch.Tensor) -> torch.Tensor:
    """Stage 1: ge_r = w_r g_r, the gradient each kept pair's expert receives. [N, D] -> [N, D],
    formed in the acc dtype and rounded once to grad_rows' dtype, into a buffer of ops.empty (on CPU
    a workspace buffer: a fresh [N, H] page-faults, moe/cpu.py "Workspace")."""
    return ops.scale_rows(grad_rows, weight_rows, out=ops.empty(tuple(grad_rows.shape), grad_rows))


def grad_gate_combine(ops, grad_rows: torch.Tensor, out_rows: torch.Tensor,
                      out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 2: dw_r = sum_d grad_rows[r, d] * out_rows[r, d] (* out_scale[r, d]) -> [N], products
    and sum in the acc dtype: rounding them to bf16 costs more accuracy than the routing
    gradient's cancellations (renormalisation, softmax) can afford.

    With (g, y) this is dL/dw for the pair. Any factorisation of the same dot works: the glu
    expert passes (g Wdown, act(hg), hu), since g . (a Wdown^T) = (g Wdown) . a with a = act(hg) hu,
    so y is never saved and a is never rounded on the way.
    """
    return ops.rowwise_dot(grad_rows, *((out_rows,) if out_scale is None else (out_rows, out_scale)))


def grad_input_combine(ops, dx_rows: torch.Tensor, row_pair: torch.Tensor, num_tokens: int,
                       top_k: int) -> torch.Tensor:
    """Stage 5: dx_t = sum over kept pairs of t of dx_r. No probability scaling: grad_combine
    already applied w. [N, H] -> [S, H] in the acc dtype."""
    return ops.combine_rows(dx_rows, row_pair, num_tokens, top_k)
