"""fGETGrad: the backward grouped GEMM that applies the activation derivative to the
incoming tile before the multiply (as FlashMoE's backward GEMM of that name does; docs/kernels.md),
for grad_post_gemm and grad_pre_gemm.

For each dispatched row r of expert e (N rows, expert-sorted; W [E, C, N_out]):

  G'_r  = g_r * act'(z_r)                 (plain; g may be gathered: g_r = G[index[r]])
        = [dA_r hu_r act'(hg_r) | dA_r act(hg_r)]   (GLU: z = h = [hg | hu], C = 2 F)
  u_r   = G'_r W_e                        [N_out]        ("unscaled")
  out_r = s_r u_r  if a row scale s is given, else u_r
  dot_r = u_r . D_r (+ G'_r . b_e)        (optional: partial sums per column tile; b [E, C]
                                          an optional per-expert vector, the glu's down bias)

G' lives only in registers: each K step loads the g, z tiles and forms G' there (tiles.
grad_operand), so dz is never written to memory. Scaling after the GEMM is exact (it is
linear) and lets one GEMM feed both the routing dot product (unscaled) and the
gradient the previous layer receives (scaled): that is how the GLU expert fuses stage 2
into stage 3, u = g Wdown, dw = u . a (+ g . bdown_e, as y = a Wdown^T + bdown), dA = w u.
The G' . b_e term is taken in the K loop (which walks G' along C) by the programs of the first
output column tile only, so it joins the row dot once and costs no extra read of G'.

Tiling: one program per (row tile of one expert from the host schedule, BLOCK_N output
columns), a K loop over C in BLOCK_K steps. The row-dot partials go to dot[r, pid_n]
([N, ceil(N_out / smallest BLOCK_N)], zero-filled) and are summed on the host, so no
atomics are needed and the result does not depend on the tuned BLOCK_N. Autotuned over
BLOCK_N, BLOCK_K, warps and stages, keyed on (N_OUT, C, BLOCK_M, GLU, ACT) and dtypes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels.activations import activation_args
from shardmoe.kernels.schedule import choose_block_m, row_tile_schedule
from shardmoe.kernels.tiles import dot_acc, grad_operand
from shardmoe.kernels.tuning import PRUNE, configs, dot_settings, unit_columns

_GPU_TILES = [{"BLOCK_N": n, "BLOCK_K": k} for n in (64, 128, 256) for k in (32, 64)]
_INTERPRETER_TILES = {"BLOCK_N": 32, "BLOCK_K": 32}
_SMALLEST_BLOCK_N = min(tiles["BLOCK_N"] for tiles in [*_GPU_TILES, _INTERPRETER_TILES])


# reset_to_zero: configs differ in BLOCK_N, hence in how many partial-dot columns they
# write; zeroing between tuning runs keeps a stale column from joining the final sum.
@triton.autotune(configs=configs(_GPU_TILES, _INTERPRETER_TILES), key=["N_OUT", "C", "BLOCK_M", "GLU", "ACT"],
                 reset_to_zero=["dot_ptr"], prune_configs_by=PRUNE)
@triton.jit
def grad_gemm_kernel(
    g_ptr, g_index_ptr, stride_g,
    z_ptr, stride_z,
    w_ptr, stride_we, stride_wc, stride_wn,
    schedule_ptr,
    out_ptr, stride_out, scale_ptr,
    unscaled_ptr, stride_unscaled,
    dot_ptr, stride_dot, other_ptr, stride_other,
    dot_bias_ptr, stride_dot_bias,
    N_OUT, C, HALF, limit, alpha,
    ACT: tl.constexpr, GLU: tl.constexpr, GATHER: tl.constexpr, SCALE: tl.constexpr,
    STORE_UNSCALED: tl.constexpr, ROW_DOT: tl.constexpr, DOT_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(schedule_ptr + tile * 3).to(tl.int64)
    row_start = tl.load(schedule_ptr + tile * 3 + 1)
    row_end = tl.load(schedule_ptr + tile * 3 + 2)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows = rows.to(tl.int64)
    if GATHER:
        g_rows = tl.load(g_index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        g_rows = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N_OUT
    w_expert = w_ptr + expert * stride_we

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bias_dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < C
        g = grad_operand(g_ptr, g_rows, stride_g, z_ptr, rows, stride_z, ks, row_mask, k_mask, HALF, limit, alpha,
                         ACT, GLU)
        w = tl.load(w_expert + ks[:, None] * stride_wc + cols[None, :] * stride_wn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = dot_acc(g, w, acc, DOT_FP32, PRECISION)
        if DOT_BIAS:
            if pid_n == 0:  # one column tile adds it, so the row dot gets it once
                b = tl.load(dot_bias_ptr + expert * stride_dot_bias + ks, mask=k_mask, other=0.0).to(tl.float32)
                bias_dot += tl.sum(g * b[None, :], axis=1)

    out_mask = row_mask[:, None] & col_mask[None, :]
    if ROW_DOT:
        other = tl.load(other_ptr + rows[:, None] * stride_other + cols[None, :], mask=out_mask, other=0.0)
        dot = tl.sum(acc * other.to(tl.float32), axis=1)
        if DOT_BIAS:
            dot += bias_dot
        tl.store(dot_ptr + rows * stride_dot + pid_n, dot, mask=row_mask)
    if STORE_UNSCALED:
        tl.store(unscaled_ptr + rows[:, None] * stride_unscaled + cols[None, :],
                 acc.to(unscaled_ptr.dtype.element_ty), mask=out_mask)
    if SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def grad_gemm(grad: torch.Tensor, weight: torch.Tensor, groups, *, grad_index: torch.Tensor | None = None,
              z: torch.Tensor | None = None, activation="identity", glu: bool = False,
              scale: torch.Tensor | None = None, keep_unscaled: bool = False,
              dot_with: torch.Tensor | None = None, dot_bias: torch.Tensor | None = None):
    """Launch grad_gemm_kernel over the N = sum(groups.sizes) dispatched rows.

    grad [N, C] ([N, C/2] for GLU; or token-order rows read through grad_index [N]);
    z [N, C] the saved pre-activation (h for GLU); weight [E, C, N_out]; `activation` a name, or
    with glu a clamped SwiGLU (activations.activation_args). dot_with [N, N_out] gives the row dots
    u_r . D_r, plus G'_r . dot_bias[e] with dot_bias [E, C] (only with dot_with).
    Returns (out [N, N_out] in grad's dtype, unscaled or None, row dots [N] float32 or None).
    """
    if dot_bias is not None and dot_with is None:
        raise ValueError("grad_gemm: dot_bias expects dot_with (it joins the row dots), got dot_with=None")
    act_args = activation_args(activation, glu)
    num_rows, width = sum(groups.sizes), weight.shape[2]
    out = grad.new_empty((num_rows, width))
    unscaled = grad.new_empty((num_rows, width)) if keep_unscaled else None
    dots = None
    if dot_with is not None:
        dots = torch.zeros((num_rows, triton.cdiv(width, _SMALLEST_BLOCK_N)), dtype=torch.float32,
                           device=grad.device)
    if num_rows == 0:
        return out, unscaled, None if dots is None else dots.sum(1)
    grad = unit_columns(grad)
    z = None if z is None else unit_columns(z)
    dot_with = None if dot_with is None else unit_columns(dot_with)
    dot_bias = None if dot_bias is None else unit_columns(dot_bias)
    block_m = choose_block_m(groups.sizes)
    schedule = row_tile_schedule(groups.sizes, block_m, grad.device)
    grid = lambda meta: (schedule.shape[0], triton.cdiv(width, meta["BLOCK_N"]))  # noqa: E731
    # the autotuner zeroes dot_ptr between candidates (reset_to_zero), and triton 3.6 calls
    # .zero_() on it even when it is None: an empty tensor stands in without row dots
    dot_out = dots if dots is not None else torch.empty(0, dtype=torch.float32, device=grad.device)
    grad_gemm_kernel[grid](
        grad, grad_index, grad.stride(0),
        z, 0 if z is None else z.stride(0),
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        schedule,
        out, out.stride(0), scale,
        unscaled, 0 if unscaled is None else unscaled.stride(0),
        dot_out, 0 if dots is None else dots.stride(0), dot_with, 0 if dot_with is None else dot_with.stride(0),
        dot_bias, 0 if dot_bias is None else dot_bias.stride(0),
        width, weight.shape[1], weight.shape[1] // 2,
        GLU=glu, GATHER=grad_index is not None, SCALE=scale is not None,
        STORE_UNSCALED=keep_unscaled, ROW_DOT=dot_with is not None, DOT_BIAS=dot_bias is not None,
        BLOCK_M=block_m, **act_args, **dot_settings(grad.dtype),
    )
    return out, unscaled, None if dots is None else dots.sum(1)
