"""The glu expert's first backward GEMM, dA' = g Wdown_e, with the rest of stages 2-4's elementwise
work in its epilogue (SonicMoE's dA' kernel).

For each dispatched row r of expert e (N rows, expert-sorted; Wdown [E, H, F]; g_r = G[index[r]],
the output gradient read in token order; w_r the routing weight; h_r = [hg_r | hu_r] saved):

  u_r    = g_r Wdown_e                               [F]    the K loop, over H
  a_r    = glu(hg_r, hu_r)                           [F]    recomputed from h (activations.glu)
  dw_r   = u_r . a_r (+ g_r . bdown_e)                      the gate dot g_r . y_r, y never stored
  dA_r   = w_r u_r
  dh_r   = [dhg_r | dhu_r] = activations.glu_backward(dA_r, hg_r, hu_r)    [2F]   stored
  a'_r   = w_r a_r                                   [F]    stored, for dWdown_e = sum g^T a'

Afterwards stage 4 is two plain GEMMs on dh (dx = dh Wgu_e, dWgu_e = sum dh^T x) and dWdown one
on (g, a'): no elementwise pass over [N, F] or [N, 2F] runs in torch, g is never gathered into
memory and u = g Wdown is never stored. The g . bdown_e term is summed in the K loop, which walks
g along H, by the programs of the first column tile only, so it joins the dot once; it is a product
on the tensor cores (tiles.vector_operand), so g goes from its pipeline buffer to the MMA without a
copy in registers.

Tiling: one program per (row tile of one expert, BLOCK_N columns of F), in grouped order on a 1-D
grid (tiles.grouped_tile); tiles.row_tile finds the row tile on the device. The row dots' partial sums of each column tile go to dot[r, pid_n]
([N, ceil(F / smallest BLOCK_N)], zero-filled) and are summed afterwards: no atomics, and the
result does not depend on the tuned BLOCK_N (reset_to_zero clears the buffer between autotune
trials, so a trial with more column tiles leaves no stale partial behind). Autotuned over BLOCK_N,
BLOCK_K, warps and stages, keyed on (F, H, BLOCK_M, ACT) and the dtypes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels.activations import activation_args, glu, glu_backward
from shardmoe.kernels.schedule import GROUP_ROWS, choose_block_m, experts_pad, row_tiles
from shardmoe.kernels.tiles import VECTOR_COLUMNS, dot_acc, grouped_tile, row_tile, source_rows, vector_operand
from shardmoe.kernels.tuning import autotune, dot_settings, unit_columns

# 64 columns only: the epilogue holds h's two halves, a and dh beside the accumulator, and at 128
# columns (two 64-column halves) it spills on an H100 (benchmarks/static_candidates.py)
_GPU_TILES = [{"BLOCK_N": 64, "BLOCK_K": k} for k in (64, 32)]
_INTERPRETER_TILES = {"BLOCK_N": 32, "BLOCK_K": 32}  # two 16-column halves: several column tiles at the tests' F
_SMALLEST_BLOCK_N = min(tiles["BLOCK_N"] for tiles in [*_GPU_TILES, _INTERPRETER_TILES])


@triton.jit
def _epilogue(acc, cols, row_mask, local, h_tile, dh_tile, a_tile, stride_h, stride_a, scale, F, limit, alpha,
              ACT: tl.constexpr):
    """The epilogue on one accumulator tile u [R, C] of columns `cols`: stores a' = s a and
    dh = dSwiGLU(s u, h) for them, returns the partial row dots u . a. h and dh share one layout, so one
    offset tile addresses both; offsets within the tile are int32 from the tile's int64 first row
    (half the registers of int64 offsets per element)."""
    mask = row_mask[:, None] & (cols < F)[None, :]
    offsets = local * stride_h + cols[None, :]
    gate = tl.load(h_tile + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_tile + offsets + F, mask=mask, other=0.0).to(tl.float32)
    a = glu(gate, up, limit, alpha, ACT)
    dot = tl.sum(acc * a, axis=1)
    tl.store(a_tile + local * stride_a + cols[None, :], (a * scale).to(a_tile.dtype.element_ty), mask=mask)
    grad_gate, grad_up = glu_backward(acc * scale, gate, up, limit, alpha, ACT)
    tl.store(dh_tile + offsets, grad_gate.to(dh_tile.dtype.element_ty), mask=mask)
    tl.store(dh_tile + offsets + F, grad_up.to(dh_tile.dtype.element_ty), mask=mask)
    return dot


@autotune(_GPU_TILES, _INTERPRETER_TILES, key=["F", "H", "BLOCK_M", "ACT"], warps_stages=((8, 3), (8, 4)),
          reset_to_zero=["dot_ptr"])
@triton.jit
def down_grad_kernel(
    g_ptr, g_index_ptr, stride_g,
    w_ptr, stride_we, stride_wh, stride_wf,
    h_ptr, dh_ptr, stride_h,
    scale_ptr,
    ends_ptr, num_experts, num_row_tiles, group_rows,
    a_ptr, stride_a,
    dot_ptr, stride_dot,
    bias_ptr, stride_be,
    F, H, limit, alpha,
    ACT: tl.constexpr, GATHER: tl.constexpr, DOT_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
):
    tile, pid_n = grouped_tile(tl.program_id(0), num_row_tiles, tl.cdiv(F, BLOCK_N), group_rows)
    expert, row_start, row_end = row_tile(tile, ends_ptr, num_experts, BLOCK_M, E_PAD)
    if expert >= num_experts:  # past the last row tile
        return
    expert = expert.to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows = rows.to(tl.int64)
    g_rows = source_rows(g_index_ptr, rows, row_mask, GATHER)
    # the tile's columns as two halves, each with its own accumulator: the epilogue then runs on one
    # half after the other, and holds half the tiles at a time
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
    cols_hi = cols + BLOCK_N // 2
    w_expert = w_ptr + expert * stride_we

    acc = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
    bias_dot = tl.zeros((BLOCK_M, VECTOR_COLUMNS), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        g = tl.load(g_ptr + g_rows[:, None] * stride_g + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_rows = w_expert + ks[:, None] * stride_wh
        w = tl.load(w_rows + cols[None, :] * stride_wf, mask=k_mask[:, None] & (cols < F)[None, :], other=0.0)
        acc = dot_acc(g, w, acc, DOT_FP32, PRECISION)
        w_hi = tl.load(w_rows + cols_hi[None, :] * stride_wf, mask=k_mask[:, None] & (cols_hi < F)[None, :], other=0.0)
        acc_hi = dot_acc(g, w_hi, acc_hi, DOT_FP32, PRECISION)
        if DOT_BIAS:
            if pid_n == 0:  # one column tile adds it, so the row dot gets it once; g b_e on the MMA
                b = tl.load(bias_ptr + expert * stride_be + ks, mask=k_mask, other=0.0).to(tl.float32)
                bias_dot = dot_acc(g, vector_operand(b, g.dtype), bias_dot, DOT_FP32, PRECISION)

    first = row_start.to(tl.int64)
    local = tl.arange(0, BLOCK_M)[:, None]
    h_tile, dh_tile, a_tile = h_ptr + first * stride_h, dh_ptr + first * stride_h, a_ptr + first * stride_a
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    dot = _epilogue(acc, cols, row_mask, local, h_tile, dh_tile, a_tile, stride_h, stride_a, scale, F, limit, alpha,
                    ACT)
    dot += _epilogue(acc_hi, cols_hi, row_mask, local, h_tile, dh_tile, a_tile, stride_h, stride_a, scale, F, limit,
                     alpha, ACT)
    if DOT_BIAS:
        dot += tl.sum(bias_dot, axis=1)
    tl.store(dot_ptr + rows * stride_dot + pid_n, dot, mask=row_mask)


def down_grad(grad: torch.Tensor, weight_rows: torch.Tensor, h: torch.Tensor, down_proj: torch.Tensor, groups,
              activation, *, grad_index: torch.Tensor | None = None, dot_bias: torch.Tensor | None = None):
    """Launch down_grad_kernel over the N = groups.num_rows dispatched rows: (dh [N, 2F], a' = w a
    [N, F], both in grad's dtype, the gate dots dw [N] float32).

    grad [N, H] (or the token-order [S, H] read through grad_index [N]); weight_rows w [N];
    h [N, 2F] the saved GLU input; down_proj [E, H, F]; `activation` a name or a clamped SwiGLU
    (activations.activation_args); dot_bias [E, H] (the down bias) adds g . bdown_e to the dots."""
    act_args = activation_args(activation, True)
    num_rows, num_experts, ffn = groups.num_rows, groups.num_experts, down_proj.shape[2]
    grad_h = grad.new_empty((num_rows, 2 * ffn))  # contiguous, as h is made below
    a_scaled = grad.new_empty((num_rows, ffn))
    dots = torch.zeros((num_rows, triton.cdiv(ffn, _SMALLEST_BLOCK_N)), dtype=torch.float32, device=grad.device)
    if num_rows == 0:
        return grad_h, a_scaled, dots.sum(1)
    grad = unit_columns(grad)
    h = h if h.stride() == grad_h.stride() else h.contiguous()
    dot_bias = None if dot_bias is None else unit_columns(dot_bias)
    block_m = choose_block_m(num_rows, num_experts)
    tiles = row_tiles(num_rows, num_experts, block_m)
    grid = lambda meta: (tiles * triton.cdiv(ffn, meta["BLOCK_N"]),)  # noqa: E731
    down_grad_kernel[grid](
        grad, grad_index, grad.stride(0),
        down_proj, down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        h, grad_h, grad_h.stride(0),
        weight_rows,
        groups.offsets, num_experts, tiles, GROUP_ROWS,
        a_scaled, a_scaled.stride(0),
        dots, dots.stride(0),
        dot_bias, 0 if dot_bias is None else dot_bias.stride(0),
        ffn, down_proj.shape[1],
        GATHER=grad_index is not None, DOT_BIAS=dot_bias is not None,
        BLOCK_M=block_m, E_PAD=experts_pad(num_experts), **act_args, **dot_settings(grad.dtype),
    )
    return grad_h, a_scaled, dots.sum(1)
