"""Device helpers shared by the GEMM kernels: the accumulating dot and fGETGrad's operand tile."""
import triton
import triton.language as tl

from shardmoe.kernels.activations import activation_grad, glu_grad


@triton.jit
def dot_acc(a, b, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b with float32 accumulation.

    DOT_FP32 (the interpreter) multiplies in float32; otherwise `a` is rounded to b's
    dtype first, so a float32 tile computed in a prologue meets bfloat16 weights on the
    tensor cores just as the torch path's bfloat16 intermediate would."""
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        out = tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)
    return out


@triton.jit
def grad_operand(g_ptr, g_rows, stride_g, z_ptr, z_rows, stride_z, cols, row_mask, col_mask, half, limit, alpha,
                 ACT: tl.constexpr, GLU: tl.constexpr):
    """fGETGrad's left operand for an [R, C] tile, float32: the incoming gradient times the
    activation derivative, formed in registers before the multiply (never stored).

      plain:  G'[r, c] = g[r, c] * act'(z[r, c])            (no z read for identity)
      GLU:    z = h = [hg | hu] [N, 2 half], g = dA [N, half], c in [0, 2 half):
              c <  half:  G'[r, c] = dhg[r, c]                                   (dA hu act'(hg))
              c >= half:  G'[r, c] = dhu[r, c'],  c' = c - half                  (dA act(hg))
              with (dhg, dhu) = activations.glu_grad, which also has the clamped SwiGLU's form
              (limit, alpha: its constants; unused otherwise)

    g_rows index the gradient (they differ from z_rows when the gradient is gathered from
    token order); z_rows index the dispatched rows. A tile may straddle the gate/up
    boundary; each column picks its formula.
    """
    mask = row_mask[:, None] & col_mask[None, :]
    if GLU:
        is_gate = cols < half
        col = tl.where(is_gate, cols, cols - half)
        grad = tl.load(g_ptr + g_rows[:, None] * stride_g + col[None, :], mask=mask, other=0.0).to(tl.float32)
        z_row = z_ptr + z_rows[:, None] * stride_z
        gate = tl.load(z_row + col[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(z_row + (col + half)[None, :], mask=mask, other=0.0).to(tl.float32)
        grad_gate, grad_up = glu_grad(grad, gate, up, limit, alpha, ACT)
        tile = tl.where(is_gate[None, :], grad_gate, grad_up)
    else:
        tile = tl.load(g_ptr + g_rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACT != "identity":
            z = tl.load(z_ptr + z_rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tile = tile * activation_grad(z, ACT)
    return tile
