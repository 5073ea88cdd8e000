"""Weight- and bias-gradient grouped GEMMs: dW_e = sum_r G'_r^T X_r, db_e = sum_r G'_r.

For expert e with rows R_e (N rows in all, expert-sorted):

  dW_e  = sum_{r in R_e} G_r^T X_r       [O, K]    G_r optionally gathered from token order (g),
                                                   X_r too (x[row_token])
  db_e  = sum_{r in R_e} s_r G_r         [O]       s an optional row scale, for the bias only

Both operands are plain: every activation derivative is formed once before (glu's dh by
down_grad.py, "mlp"'s dz2 by combine.py and dz1 by grad_gemm.py). Covers dW1/db1 (G = dz1,
X = x), dW2/db2 (G = dz2, X = a1), dWgate_up (G = dh, X = x) and dWdown (G = g, X = a' = w a from
down_grad.py, and dbdown = sum w g).

A varlen-K grouped GEMM: the reduction dimension is each expert's row count, so it tiles the output.
The E x ceil(O / BLOCK_O) x ceil(K / BLOCK_K) output tiles are taken by persistent programs (one
per multiprocessor, schedule.persistent_programs), tile after tile, in expert-major order so that
the programs running side by side read the same expert's rows; each tile walks its expert's rows
BLOCK_R at a time, reading the expert's bounds from the groups' ends on the device. Each dW element
has one owner, so there are no atomics and an empty expert stores zeros. The bias is summed from
the same G tiles by the tiles of the first K column, on the tensor cores (tiles.vector_operand), so G
goes from its pipeline buffer to the MMA without a copy in registers. Autotuned over BLOCK_O, BLOCK_K, BLOCK_R,
warps and stages, keyed on (O, K) and the dtypes.

A very uneven routing leaves the tiles of one expert with most of the rows; splitting the row loop
would need a second reduction pass (noted in docs/kernels.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels.schedule import persistent_programs
from shardmoe.kernels.tiles import VECTOR_COLUMNS, dot_acc, expert_rows, source_rows, vector_operand
from shardmoe.kernels.tuning import autotune, dot_settings, unit_columns

# SonicMoE's 128 x 256 output tiles with 64-row steps first
_GPU_TILES = [{"BLOCK_O": o, "BLOCK_K": k, "BLOCK_R": 64} for o, k in ((128, 256), (128, 128), (256, 128))]


@autotune(_GPU_TILES, {"BLOCK_O": 32, "BLOCK_K": 32, "BLOCK_R": 16}, key=["O", "K"],
          warps_stages=((8, 3), (8, 4)))
@triton.jit
def weight_grad_kernel(
    g_ptr, g_index_ptr, stride_g,
    x_ptr, x_index_ptr, stride_x,
    ends_ptr, num_experts,
    dw_ptr, stride_de, stride_do, stride_dk,
    db_ptr, stride_dbe, bias_scale_ptr,
    O, K,
    GATHER_G: tl.constexpr, GATHER_X: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_SCALE: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tiles_o = tl.cdiv(O, BLOCK_O)
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_expert = tiles_o * tiles_k
    for tile in range(tl.program_id(0), num_experts * per_expert, tl.num_programs(0)):
        expert = tile // per_expert
        rest = tile - expert * per_expert
        pid_o = rest // tiles_k
        pid_k = rest - pid_o * tiles_k
        start, end = expert_rows(expert, ends_ptr)
        o_cols = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        o_mask = o_cols < O
        k_cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = k_cols < K

        acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
        bias = tl.zeros((BLOCK_O, VECTOR_COLUMNS), dtype=tl.float32)
        rows = (start + tl.arange(0, BLOCK_R)).to(tl.int64)
        g_rows = source_rows(g_index_ptr, rows, rows < end, GATHER_G)
        x_rows = source_rows(x_index_ptr, rows, rows < end, GATHER_X)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_mask = rows < end
            rows = rows.to(tl.int64)
            # the next step's source rows, read a step ahead: the tile loads' addresses are then carried
            # by the loop instead of coming from a load of the same step, which the pipeliner would
            # space out (one buffer fewer, and a wait for every copy each step)
            next_rows = rows + BLOCK_R
            next_g_rows = source_rows(g_index_ptr, next_rows, next_rows < end, GATHER_G)
            next_x_rows = source_rows(x_index_ptr, next_rows, next_rows < end, GATHER_X)
            g = tl.load(g_ptr + g_rows[:, None] * stride_g + o_cols[None, :], mask=row_mask[:, None] & o_mask[None, :],
                        other=0.0)
            x = tl.load(x_ptr + x_rows[:, None] * stride_x + k_cols[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc = dot_acc(tl.trans(g), x, acc, DOT_FP32, PRECISION)
            if HAS_BIAS:
                if pid_k == 0:  # every K column sums the same bias; one of them does, as G^T s on the MMA
                    if BIAS_SCALE:
                        scale = tl.load(bias_scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
                    else:
                        scale = tl.where(row_mask, 1.0, 0.0)
                    bias = dot_acc(tl.trans(g), vector_operand(scale, g.dtype), bias, DOT_FP32, PRECISION)
            g_rows, x_rows = next_g_rows, next_x_rows

        expert = expert.to(tl.int64)
        dw = dw_ptr + expert * stride_de + o_cols[:, None] * stride_do + k_cols[None, :] * stride_dk
        tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=o_mask[:, None] & k_mask[None, :])
        if HAS_BIAS:
            if pid_k == 0:
                tl.store(db_ptr + expert * stride_dbe + o_cols, tl.sum(bias, axis=1).to(db_ptr.dtype.element_ty),
                         mask=o_mask)


def weight_and_bias_grad(grad: torch.Tensor, x: torch.Tensor, groups, *,
                         grad_index: torch.Tensor | None = None, x_index: torch.Tensor | None = None,
                         with_bias: bool = False, bias_scale: torch.Tensor | None = None):
    """Launch weight_grad_kernel: (dW [E, width, K], db [E, width] or None), in grad's dtype.

    grad [N, width] (or token-order rows through grad_index [N]); x [N, K] (or token-order rows
    through x_index [N]); bias_scale [N] the row scale of the bias sum only (with_bias).
    """
    num_experts, width, in_width = groups.num_experts, grad.shape[1], x.shape[1]
    dw = grad.new_empty((num_experts, width, in_width))
    db = grad.new_empty((num_experts, width)) if with_bias else None
    if dw.numel() == 0:
        return dw, db
    grad, x = unit_columns(grad), unit_columns(x)

    def grid(meta):
        tiles = num_experts * triton.cdiv(width, meta["BLOCK_O"]) * triton.cdiv(in_width, meta["BLOCK_K"])
        return (persistent_programs(grad.device, tiles),)

    weight_grad_kernel[grid](
        grad, grad_index, grad.stride(0),
        x, x_index, x.stride(0),
        groups.offsets, num_experts,
        dw, dw.stride(0), dw.stride(1), dw.stride(2),
        db, 0 if db is None else db.stride(0), bias_scale,
        width, in_width,
        GATHER_G=grad_index is not None, GATHER_X=x_index is not None,
        HAS_BIAS=with_bias, BIAS_SCALE=bias_scale is not None, **dot_settings(grad.dtype),
    )
    return dw, db
