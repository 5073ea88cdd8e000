"""fGETGrad: the input-gradient grouped GEMM, with the activation derivative applied to the
incoming tile before the multiply (as FlashMoE's backward GEMM of that name does; docs/kernels.md).

For each dispatched row r of expert e (N rows, expert-sorted; W [E, C, N_out]):

  G'_r  = g_r * act'(z_r)                 (g_r itself for identity)
  out_r = G'_r W_e                        [N_out]

G' lives only in registers: each K step loads the g, z tiles and forms G' there (tiles.
grad_operand), so dz is never written to memory. Used for da1 = dz2 W2 and dx = dz1 W1 ("mlp"),
dx = dh Wgu ("glu", identity: dh is formed once, by glu_grad.py) and grouped_linear_t.

Tiling: one program per (row tile of one expert, found on the device by tiles.row_tile; BLOCK_N
output columns), a K loop over C in BLOCK_K steps. Autotuned over BLOCK_N, BLOCK_K, warps and
stages, keyed on (N_OUT, C, BLOCK_M, ACT) and the dtypes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels.schedule import choose_block_m, experts_pad, row_tiles
from shardmoe.kernels.tiles import dot_acc, grad_operand, row_tile
from shardmoe.kernels.tuning import autotune, dot_settings, unit_columns

_GPU_TILES = [{"BLOCK_N": n, "BLOCK_K": k} for n in (128, 256, 64) for k in (64, 32)]


@autotune(_GPU_TILES, {"BLOCK_N": 32, "BLOCK_K": 32}, key=["N_OUT", "C", "BLOCK_M", "ACT"],
          warps_stages=((8, 3), (4, 3), (8, 4)))
@triton.jit
def grad_gemm_kernel(
    g_ptr, stride_g,
    z_ptr, stride_z,
    w_ptr, stride_we, stride_wc, stride_wn,
    ends_ptr, num_experts,
    out_ptr, stride_out,
    N_OUT, C,
    ACT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
):
    expert, row_start, row_end = row_tile(tl.program_id(0), ends_ptr, num_experts, BLOCK_M, E_PAD)
    if expert >= num_experts:  # past the last row tile
        return
    expert = expert.to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N_OUT
    w_expert = w_ptr + expert * stride_we

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < C
        g = grad_operand(g_ptr, rows, stride_g, z_ptr, rows, stride_z, ks, row_mask, k_mask, ACT)
        w = tl.load(w_expert + ks[:, None] * stride_wc + cols[None, :] * stride_wn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = dot_acc(g, w, acc, DOT_FP32, PRECISION)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def grad_gemm(grad: torch.Tensor, weight: torch.Tensor, groups, *, z: torch.Tensor | None = None,
              activation: str = "identity") -> torch.Tensor:
    """Launch grad_gemm_kernel over the N = groups.num_rows dispatched rows: out [N, N_out] in
    grad's dtype for grad [N, C], z [N, C] the saved pre-activation (not read for identity),
    weight [E, C, N_out]."""
    num_rows, num_experts, width = groups.num_rows, groups.num_experts, weight.shape[2]
    out = grad.new_empty((num_rows, width))
    if num_rows == 0:
        return out
    grad = unit_columns(grad)
    z = None if z is None else unit_columns(z)
    block_m = choose_block_m(num_rows, num_experts)
    tiles = row_tiles(num_rows, num_experts, block_m)
    grid = lambda meta: (tiles, triton.cdiv(width, meta["BLOCK_N"]))  # noqa: E731
    grad_gemm_kernel[grid](
        grad, grad.stride(0),
        z, 0 if z is None else z.stride(0),
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        groups.offsets, num_experts,
        out, out.stride(0),
        width, weight.shape[1],
        ACT=activation, BLOCK_M=block_m, E_PAD=experts_pad(num_experts), **dot_settings(grad.dtype),
    )
    return out
