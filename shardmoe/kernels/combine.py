"""Combine-side kernels and the wrappers that replace shardmoe/moe/combine.py on CUDA.

Rows [N, H] are the expert-sorted dispatched rows; row r is the kept pair row_pair[r] =
t * k + j. Two kernels:

  token_combine_kernel      out_t = sum_j s_{r(t,j)} rows[r(t, j)]      [S, H]
      r(t, j) = pair_row[t * k + j], the inverse of row_pair (-1 for a dropped pair).
      One program per (BLOCK_T tokens, BLOCK_H columns) gathers each token's k rows and
      sums them in float32 registers: every output element has one owner, so there are
      no atomics and the sum order is fixed (deterministic). Serves combine (s = w) and
      grad_input_combine (no s).
  gate_dots_kernel          dw_r = g_r . act_out(z2_r)   and, when asked, dz2_r = w_r g_r act_out'(z2_r)
      Stage 2 (grad_gate_combine), with stage 1 and "mlp"'s output-activation derivative in the
      same pass (grad_combine_and_gate_dots): one program per BLOCK_R rows walks H in BLOCK_H
      steps, reading g_r (optionally gathered from token order) and the saved z2_r (y_r itself for
      an identity act_out) exactly once each.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels.activations import activation, activation_grad
from shardmoe.kernels.tiles import source_rows
from shardmoe.kernels.tuning import autotune, unit_columns
from shardmoe.rows import accumulation_dtype


@autotune([{"BLOCK_T": t, "BLOCK_H": h} for t in (16, 32) for h in (128, 256)], {"BLOCK_T": 16, "BLOCK_H": 32},
          key=["H", "TOP_K"], warps_stages=((4, 3),))
@triton.jit
def token_combine_kernel(rows_ptr, stride_rows, scale_ptr, pair_row_ptr, out_ptr, stride_out, S, H,
                         TOP_K: tl.constexpr, SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < S
    tokens = tokens.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pair_row_ptr + tokens * TOP_K + j, mask=token_mask, other=-1)
        kept = row >= 0
        row = tl.where(kept, row, 0).to(tl.int64)
        vals = tl.load(rows_ptr + row[:, None] * stride_rows + cols[None, :],
                       mask=kept[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if SCALE:
            vals = vals * tl.load(scale_ptr + row, mask=kept, other=0.0).to(tl.float32)[:, None]
        acc += vals
    tl.store(out_ptr + tokens[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=token_mask[:, None] & col_mask[None, :])


@autotune([{"BLOCK_R": r, "BLOCK_H": h} for r in (16, 32) for h in (128, 256)], {"BLOCK_R": 16, "BLOCK_H": 32},
          key=["H", "OUT_ACT", "STORE_GE"], warps_stages=((4, 3),))
@triton.jit
def gate_dots_kernel(g_ptr, g_index_ptr, stride_g, y_ptr, stride_y, scale_ptr, ge_ptr, stride_ge, dw_ptr,
                             N, H, OUT_ACT: tl.constexpr, GATHER: tl.constexpr, STORE_GE: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < N
    rows = rows.to(tl.int64)
    g_rows = source_rows(g_index_ptr, rows, row_mask, GATHER)
    if STORE_GE:
        weight = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < H)[None, :]
        g = tl.load(g_ptr + g_rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if STORE_GE:
            ge = g * weight[:, None]
            if OUT_ACT != "identity":
                ge = ge * activation_grad(y, OUT_ACT)
            tl.store(ge_ptr + rows[:, None] * stride_ge + cols[None, :], ge.to(ge_ptr.dtype.element_ty), mask=mask)
        dot += tl.sum(g * activation(y, OUT_ACT), axis=1)
    tl.store(dw_ptr + rows, dot, mask=row_mask)


def _token_combine(rows: torch.Tensor, scale: torch.Tensor | None, row_pair: torch.Tensor, num_tokens: int,
                   top_k: int) -> torch.Tensor:
    out = rows.new_empty((num_tokens, rows.shape[-1]), dtype=accumulation_dtype(rows.dtype))
    if out.numel() == 0:
        return out
    rows = unit_columns(rows)
    pair_row = torch.full((num_tokens * top_k,), -1, dtype=torch.int32, device=rows.device)
    pair_row[row_pair] = torch.arange(row_pair.numel(), dtype=torch.int32, device=rows.device)
    width = rows.shape[-1]
    grid = lambda meta: (triton.cdiv(num_tokens, meta["BLOCK_T"]), triton.cdiv(width, meta["BLOCK_H"]))  # noqa: E731
    token_combine_kernel[grid](rows, rows.stride(0), scale, pair_row, out, out.stride(0), num_tokens, width,
                               TOP_K=top_k, SCALE=scale is not None)
    return out


def _gate_dots(grad_rows, out_rows, weight_rows, *, row_index, output_activation, store_ge):
    num_rows = out_rows.shape[0]
    width = grad_rows.shape[-1]
    ge = grad_rows.new_empty((num_rows, width)) if store_ge else None
    dw = grad_rows.new_empty((num_rows,), dtype=accumulation_dtype(grad_rows.dtype))
    if num_rows == 0:
        return ge, dw
    grad_rows = unit_columns(grad_rows)
    out_rows = unit_columns(out_rows)
    grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_R"]),)  # noqa: E731
    gate_dots_kernel[grid](
        grad_rows, row_index, grad_rows.stride(0), out_rows, out_rows.stride(0),
        weight_rows, ge, 0 if ge is None else ge.stride(0), dw, num_rows, width,
        OUT_ACT=output_activation, GATHER=row_index is not None, STORE_GE=store_ge,
    )
    return ge, dw


def combine(expert_out: torch.Tensor, weight_rows: torch.Tensor, row_pair: torch.Tensor,
            num_tokens: int, top_k: int) -> torch.Tensor:
    """Replaces combine.combine: out_t = sum_j w_tj y_j(x_t) over kept pairs. [S, H], acc dtype."""
    return _token_combine(expert_out, weight_rows, row_pair, num_tokens, top_k)


def grad_input_combine(dx_rows: torch.Tensor, row_pair: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Replaces combine.grad_input_combine: dx_t = sum over kept pairs of dx_r. [S, H], acc dtype."""
    return _token_combine(dx_rows, None, row_pair, num_tokens, top_k)


def grad_gate_combine(grad_rows: torch.Tensor, out_rows: torch.Tensor) -> torch.Tensor:
    """Replaces combine.grad_gate_combine: dw_r = sum_d grad_rows[r, d] out_rows[r, d]. [N], acc dtype."""
    return _gate_dots(grad_rows, out_rows, None, row_index=None, output_activation="identity", store_ge=False)[1]


def grad_combine_and_gate_dots(grad_rows: torch.Tensor, out_rows: torch.Tensor, weight_rows: torch.Tensor, *,
                               output_activation: str = "identity", row_index: torch.Tensor | None = None):
    """Stages 1 and 2 and the output activation's derivative fused, reading g and the saved z2 once:
      dz2_r = w_r g_r act_out'(z2_r)  [N, H] (g's dtype)   and   dw_r = g_r . act_out(z2_r)  [N] (acc dtype).

    out_rows [N, H] is the saved pre-activation (z2 for "mlp", act_out and act_out' applied in
    the kernel) or y itself with output_activation="identity" (then dz2 = w g). With row_index
    [N], grad_rows is the token-order gradient [S, H] and row r reads grad_rows[row_index[r]],
    so the gathered copy grad_out[row_token] is never made. Equals
    (w g act_out'(z2), grad_gate_combine(g, act_out(z2))) with g = grad_rows[row_index].
    """
    return _gate_dots(grad_rows, out_rows, weight_rows, row_index=row_index, output_activation=output_activation,
                      store_ge=True)
