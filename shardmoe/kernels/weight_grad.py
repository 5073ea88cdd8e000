"""Weight- and bias-gradient grouped GEMMs: dW_e = sum_r G'_r^T X_r, db_e = sum_r G'_r.

For expert e with rows R_e (N rows in all, expert-sorted):

  G'_r  = s_r g_r act'(z_r)    (the same fGETGrad operand as grad_gemm.py: plain or
                                GLU, g optionally gathered, s an optional row scale)
  dW_e  = sum_{r in R_e} G'_r^T X_r      [O, K]    X_r optionally gathered (x[row_token])
  db_e  = sum_{r in R_e} G'_r            [O]

Covers dW1/db1 (G' = dz1, X = x), dW2/db2 (G' = dz2, X = a1), dWgate_up (GLU operand,
X = x) and dWdown (G' = w g, X = a). The reduction runs over rows, so it tiles the
output instead: one program per (expert, BLOCK_O rows of dW, BLOCK_K columns of dW),
walking the expert's rows BLOCK_R at a time. Each dW element has one owner, so there
are no atomics and an empty expert simply stores zeros. The bias is summed from the
same G' tiles by the programs of the first K column. Autotuned over BLOCK_O, BLOCK_K,
BLOCK_R, warps and stages, keyed on (O, K, GLU, ACT) and the dtypes.

A very uneven routing leaves one expert's programs doing most of the work; splitting
the row loop would need a second reduction pass (noted in docs/kernels.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels.activations import activation_args
from shardmoe.kernels.schedule import group_bounds
from shardmoe.kernels.tiles import dot_acc, grad_operand
from shardmoe.kernels.tuning import PRUNE, configs, dot_settings, unit_columns

_GPU_TILES = [{"BLOCK_O": o, "BLOCK_K": k, "BLOCK_R": r}
              for o, k in ((64, 64), (128, 64), (64, 128), (128, 128)) for r in (32, 64)]


@triton.autotune(configs=configs(_GPU_TILES, {"BLOCK_O": 32, "BLOCK_K": 32, "BLOCK_R": 32}),
                 key=["O", "K", "GLU", "ACT"], prune_configs_by=PRUNE)
@triton.jit
def weight_grad_kernel(
    g_ptr, g_index_ptr, stride_g,
    z_ptr, stride_z, scale_ptr,
    x_ptr, x_index_ptr, stride_x,
    bounds_ptr,
    dw_ptr, stride_de, stride_do, stride_dk,
    db_ptr, stride_dbe,
    O, K, HALF, limit, alpha,
    ACT: tl.constexpr, GLU: tl.constexpr, GATHER_G: tl.constexpr, GATHER_X: tl.constexpr,
    SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    expert = tl.program_id(0)
    pid_k = tl.program_id(2)
    start = tl.load(bounds_ptr + expert)
    end = tl.load(bounds_ptr + expert + 1)
    o_cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = o_cols < O
    k_cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = k_cols < K

    acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
    bias = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < end
        rows = rows.to(tl.int64)
        if GATHER_G:
            g_rows = tl.load(g_index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            g_rows = rows
        if GATHER_X:
            x_rows = tl.load(x_index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            x_rows = rows
        g = grad_operand(g_ptr, g_rows, stride_g, z_ptr, rows, stride_z, o_cols, row_mask, o_mask, HALF, limit,
                         alpha, ACT, GLU)
        if SCALE:
            g = g * tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        x = tl.load(x_ptr + x_rows[:, None] * stride_x + k_cols[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = dot_acc(tl.trans(g), x, acc, DOT_FP32, PRECISION)
        if HAS_BIAS:
            bias += tl.sum(g, axis=0)

    dw = dw_ptr + expert.to(tl.int64) * stride_de + o_cols[:, None] * stride_do + k_cols[None, :] * stride_dk
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=o_mask[:, None] & k_mask[None, :])
    if HAS_BIAS:
        if pid_k == 0:  # every K column sums the same bias; one of them stores it
            tl.store(db_ptr + expert.to(tl.int64) * stride_dbe + o_cols, bias.to(db_ptr.dtype.element_ty),
                     mask=o_mask)


def weight_grad(grad: torch.Tensor, x: torch.Tensor, groups, *, width: int,
                grad_index: torch.Tensor | None = None, x_index: torch.Tensor | None = None,
                z: torch.Tensor | None = None, activation="identity", glu: bool = False,
                scale: torch.Tensor | None = None, with_bias: bool = False):
    """Launch weight_grad_kernel: (dW [E, width, K], db [E, width] or None), in grad's dtype.

    grad [N, width] ([N, width/2] for GLU; or token-order rows through grad_index [N]);
    x [N, K] (or token-order rows through x_index [N]); z [N, width] the saved
    pre-activation; scale [N] the row scale; `activation` a name, or with glu a clamped SwiGLU
    (activations.activation_args).
    """
    act_args = activation_args(activation, glu)
    num_experts, in_width = len(groups.sizes), x.shape[1]
    dw = grad.new_empty((num_experts, width, in_width))
    db = grad.new_empty((num_experts, width)) if with_bias else None
    if dw.numel() == 0:
        return dw, db
    grad, x = unit_columns(grad), unit_columns(x)
    z = None if z is None else unit_columns(z)
    bounds = group_bounds(groups.sizes, grad.device)
    def grid(meta):
        return num_experts, triton.cdiv(width, meta["BLOCK_O"]), triton.cdiv(in_width, meta["BLOCK_K"])

    weight_grad_kernel[grid](
        grad, grad_index, grad.stride(0),
        z, 0 if z is None else z.stride(0), scale,
        x, x_index, x.stride(0),
        bounds,
        dw, dw.stride(0), dw.stride(1), dw.stride(2),
        db, 0 if db is None else db.stride(0),
        width, in_width, width // 2,
        GLU=glu, GATHER_G=grad_index is not None, GATHER_X=x_index is not None,
        SCALE=scale is not None, HAS_BIAS=with_bias,
        **act_args, **dot_settings(grad.dtype),
    )
    return dw, db


@triton.autotune(configs=configs([{"BLOCK_O": o, "BLOCK_R": 64} for o in (128, 256)], {"BLOCK_O": 32, "BLOCK_R": 32}),
                 key=["O"], prune_configs_by=PRUNE)
@triton.jit
def bias_grad_kernel(g_ptr, stride_g, bounds_ptr, db_ptr, stride_dbe, O,
                     BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    """db[e, o] = sum over the rows r of expert e of g[r, o], float32 accumulation."""
    expert = tl.program_id(0)
    start = tl.load(bounds_ptr + expert)
    end = tl.load(bounds_ptr + expert + 1)
    cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    col_mask = cols < O
    acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        tile = tl.load(g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :],
                       mask=(rows < end)[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(tile.to(tl.float32), axis=0)
    tl.store(db_ptr + expert.to(tl.int64) * stride_dbe + cols, acc.to(db_ptr.dtype.element_ty), mask=col_mask)


def bias_grad(grad: torch.Tensor, groups) -> torch.Tensor:
    """db [E, O] in grad's dtype for grad [N, O] (the standalone grouped_bias_grad)."""
    num_experts, width = len(groups.sizes), grad.shape[1]
    db = grad.new_empty((num_experts, width))
    if db.numel() == 0:
        return db
    grad = unit_columns(grad)
    bounds = group_bounds(groups.sizes, grad.device)
    grid = lambda meta: (num_experts, triton.cdiv(width, meta["BLOCK_O"]))  # noqa: E731
    bias_grad_kernel[grid](grad, grad.stride(0), bounds, db, db.stride(0), width)
    return db
