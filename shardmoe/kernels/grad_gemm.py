"""The input-gradient grouped GEMM, with an activation derivative in its epilogue.

For each dispatched row r of expert e (N rows, expert-sorted; W [E, C, N_out]):

  out_r = (g_r W_e) * act'(z_r)           [N_out]   (z [N, N_out]; g_r W_e itself for identity)

The derivative is applied once, to the product, where the torch path applies it to a stored
gradient: "mlp"'s dz1 = (dz2 W2_e) * act'(z1) comes out of the GEMM that makes da1, so the GEMMs
after it read plain operands (as glu's dh comes out of down_grad.py). Used for dz1 ("mlp", with
its activation), dx = dz1 W1 and dx = dh Wgu (identity).

Tiling: one program per (row tile of one expert, found on the device by tiles.row_tile; BLOCK_N
output columns), in grouped order on a 1-D grid (tiles.grouped_tile), a K loop over C in BLOCK_K steps. Autotuned over BLOCK_N, BLOCK_K, warps and
stages, keyed on (N_OUT, C, BLOCK_M, ACT) and the dtypes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels.schedule import GROUP_ROWS, choose_block_m, experts_pad, row_tiles
from shardmoe.kernels.activations import activation_grad
from shardmoe.kernels.tiles import dot_acc, grouped_tile, row_tile
from shardmoe.kernels.tuning import autotune, dot_settings, unit_columns

# 64 columns first: with a derivative in the epilogue (gelu), 128 spill on an H100 (--only static)
_GPU_TILES = [{"BLOCK_N": n, "BLOCK_K": 64} for n in (64, 128, 256)]


@autotune(_GPU_TILES, {"BLOCK_N": 32, "BLOCK_K": 32}, key=["N_OUT", "C", "BLOCK_M", "ACT"],
          warps_stages=((8, 3), (8, 4)))
@triton.jit
def grad_gemm_kernel(
    g_ptr, stride_g,
    z_ptr, stride_z,
    w_ptr, stride_we, stride_wc, stride_wn,
    ends_ptr, num_experts, num_row_tiles, group_rows,
    out_ptr, stride_out,
    N_OUT, C,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
):
    tile, pid_n = grouped_tile(tl.program_id(0), num_row_tiles, tl.cdiv(N_OUT, BLOCK_N), group_rows)
    expert, row_start, row_end = row_tile(tile, ends_ptr, num_experts, BLOCK_M, E_PAD)
    if expert >= num_experts:  # past the last row tile
        return
    expert = expert.to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N_OUT
    w_expert = w_ptr + expert * stride_we

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < C
        g = tl.load(g_ptr + rows[:, None] * stride_g + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_expert + ks[:, None] * stride_wc + cols[None, :] * stride_wn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = dot_acc(g, w, acc, DOT_FP32, PRECISION)
    mask = row_mask[:, None] & col_mask[None, :]
    if ACT != "identity":
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc * activation_grad(z, ACT)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def grad_gemm(grad: torch.Tensor, weight: torch.Tensor, groups, *, z: torch.Tensor | None = None,
              activation: str = "identity") -> torch.Tensor:
    """Launch grad_gemm_kernel over the N = groups.num_rows dispatched rows: out [N, N_out] in
    grad's dtype for grad [N, C], weight [E, C, N_out] and z [N, N_out] the saved pre-activation
    of the output's columns (not read for identity)."""
    num_rows, num_experts, width = groups.num_rows, groups.num_experts, weight.shape[2]
    out = grad.new_empty((num_rows, width))
    if num_rows == 0:
        return out
    grad = unit_columns(grad)
    z = None if z is None else unit_columns(z)
    block_m = choose_block_m(num_rows, num_experts)
    tiles = row_tiles(num_rows, num_experts, block_m)
    grid = lambda meta: (tiles * triton.cdiv(width, meta["BLOCK_N"]),)  # noqa: E731
    grad_gemm_kernel[grid](
        grad, grad.stride(0),
        z, 0 if z is None else z.stride(0),
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        groups.offsets, num_experts, tiles, GROUP_ROWS,
        out, out.stride(0),
        width, weight.shape[1],
        ACT=activation, BLOCK_M=block_m, E_PAD=experts_pad(num_experts), **dot_settings(grad.dtype),
    )
    return out
