"""The forward grouped GEMM: gathered rows in, the activation fused in the epilogue.

For each dispatched row r of expert e (N rows, expert-sorted; W [E, O_total, K]):

  a_r   = A[index[r]] if an index is given (the in-kernel gather: x[row_token] is never
          materialised) else A[r]                                              [K]
  z_r   = a_r W_e^T (+ b_e)                                                   [O_total]
  post_r = act(z_r)                          (O = O_total)
         = glu(z_r[:O], z_r[O:])            (GLU: O_total = 2 O; rows 0:O gate, O:2O up;
                                             act(hg) hu, or the clamped SwiGLU: activations.py)

Outputs: `pre` [N, O_total] = z (what backward saves: h for GLU, z1 or z2 for MLP, and the
expert output y itself for an identity output activation) and `post` [N, O].

Tiling: one program per (row tile of one expert, BLOCK_N output columns), in grouped order on a
1-D grid (tiles.grouped_tile); the program finds its row tile from the groups' ends on the device
(tiles.row_tile), so the launch reads nothing from the device; the K loop walks BLOCK_K columns of
a and of W_e. GLU keeps two accumulators (gate
and up columns n and O + n), so the epilogue has both halves of the product in registers.
Autotuned over BLOCK_N, BLOCK_K, warps and stages, keyed on (O, K, BLOCK_M, GLU, ACT) and the
dtypes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels.activations import activation, activation_args, glu
from shardmoe.kernels.schedule import GROUP_ROWS, choose_block_m, experts_pad, row_tiles
from shardmoe.kernels.tiles import dot_acc, grouped_tile, row_tile, source_rows
from shardmoe.kernels.tuning import autotune, dot_settings, unit_columns

# The first is the untuned default: 64 columns, as the GLU keeps two accumulators (gate and up), and
# at 128 rows two 128-column ones spill on an H100 (python -m shardmoe.tools.gpu_check --only static).
# Few candidates: each is a compile of every variant on a bare GPU, within a lease's minutes.
_GPU_TILES = [{"BLOCK_N": n, "BLOCK_K": 64} for n in (64, 128)]


@autotune(_GPU_TILES, {"BLOCK_N": 32, "BLOCK_K": 32}, key=["O", "K", "BLOCK_M", "GLU", "ACT"],
          warps_stages=((8, 3), (8, 4)))
@triton.jit
def forward_gemm_kernel(
    a_ptr, a_index_ptr, stride_a,
    w_ptr, stride_we, stride_wo, stride_wk,
    bias_ptr, stride_be,
    ends_ptr, num_experts, num_row_tiles, group_rows,
    pre_ptr, stride_pre,
    post_ptr, stride_post,
    O, K, limit, alpha,
    ACT: tl.constexpr, GLU: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_POST: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
):
    tile, pid_n = grouped_tile(tl.program_id(0), num_row_tiles, tl.cdiv(O, BLOCK_N), group_rows)
    expert, row_start, row_end = row_tile(tile, ends_ptr, num_experts, BLOCK_M, E_PAD)
    if expert >= num_experts:  # past the last row tile
        return
    expert = expert.to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows = rows.to(tl.int64)  # row * stride can pass 2^31 elements
    a_rows = source_rows(a_index_ptr, rows, row_mask, GATHER)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < O
    w_expert = w_ptr + expert * stride_we

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GLU:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_expert + ks[:, None] * stride_wk + cols[None, :] * stride_wo, mask=w_mask, other=0.0)
        acc = dot_acc(a, w, acc, DOT_FP32, PRECISION)
        if GLU:
            w_up = tl.load(w_expert + ks[:, None] * stride_wk + (cols + O)[None, :] * stride_wo,
                           mask=w_mask, other=0.0)
            acc_up = dot_acc(a, w_up, acc_up, DOT_FP32, PRECISION)
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_be
        acc += tl.load(bias_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GLU:  # the up half's bias, columns O + n
            acc_up += tl.load(bias_row + O + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]

    out_mask = row_mask[:, None] & col_mask[None, :]
    pre = pre_ptr + rows[:, None] * stride_pre + cols[None, :]
    tl.store(pre, acc.to(pre_ptr.dtype.element_ty), mask=out_mask)
    if GLU:
        tl.store(pre + O, acc_up.to(pre_ptr.dtype.element_ty), mask=out_mask)
    if STORE_POST:
        if GLU:
            post = glu(acc, acc_up, limit, alpha, ACT)
        else:
            post = activation(acc, ACT)
        tl.store(post_ptr + rows[:, None] * stride_post + cols[None, :], post.to(post_ptr.dtype.element_ty),
                 mask=out_mask)


def forward_gemm(a: torch.Tensor, weight: torch.Tensor, groups, *, a_index: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, activation="identity", glu: bool = False,
                 post: torch.Tensor | None = None) -> torch.Tensor:
    """Launch forward_gemm_kernel over the N = groups.num_rows dispatched rows.

    a [N, K] (or [S, K] gathered through a_index [N]); weight [E, O_total, K]; bias
    [E, O_total] (for GLU both halves' biases, [E, 2 O]). Returns pre [N, O_total] in a's dtype;
    `post` (preallocated [N, O]) receives the activation. `activation` is a name, or with glu a
    clamped SwiGLU (activations.activation_args). Row strides may be anything; columns must be
    unit-stride.
    """
    act_args = activation_args(activation, glu)
    num_rows, num_experts = groups.num_rows, groups.num_experts
    out_total = weight.shape[1]
    width = out_total // 2 if glu else out_total
    pre = a.new_empty((num_rows, out_total))
    if num_rows == 0:
        return pre
    a = unit_columns(a)
    bias = None if bias is None else unit_columns(bias)
    block_m = choose_block_m(num_rows, num_experts)
    tiles = row_tiles(num_rows, num_experts, block_m)
    grid = lambda meta: (tiles * triton.cdiv(width, meta["BLOCK_N"]),)  # noqa: E731
    forward_gemm_kernel[grid](
        a, a_index, a.stride(0),
        weight, weight.stride(0), weight.stride(1), weight.stride(2),
        bias, 0 if bias is None else bias.stride(0),
        groups.offsets, num_experts, tiles, GROUP_ROWS,
        pre, pre.stride(0),
        post, 0 if post is None else post.stride(0),
        width, a.shape[1],
        GLU=glu, GATHER=a_index is not None, HAS_BIAS=bias is not None,
        STORE_POST=post is not None,
        BLOCK_M=block_m, E_PAD=experts_pad(num_experts), **act_args, **dot_settings(a.dtype),
    )
    return pre
