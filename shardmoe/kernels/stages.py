"""The expert stages on the kernels: what shardmoe/moe/triton_ops.py's TritonOps runs.

expert_forward has the semantics of TorchOps.expert_forward (shardmoe/moe/experts.py);
glu_expert_backward (stages 2-4 of the "glu" expert, SonicMoE's data flow) and mlp_expert_backward
(stages 1-4 of "mlp") fuse across stages and have no single torch counterpart. The keyword-only
row_index switches on the fusion the torch path cannot express:

  row_index   [N] int: the rows argument is the token-order matrix ([S, H]: x or
              grad_out) and row r reads row row_index[r] inside the kernel, so the
              gathered copy x[row_token] / grad_out[row_token] is never made.

Outputs are in the input dtype (float32 accumulation inside), as in the torch path.

Every expert kind of the torch path runs here: "glu" with or without its biases
(gate_up_proj_bias [E, 2F], down_proj_bias [E, H]) and with an activation name or a
clamped SwiGLU (activations.activation_args), "mlp" with or without b1, b2. The entry points
take the kind (shardmoe/expert_kinds.py, a leaf), which names the parameters and says what the
forward saves.
"""
from __future__ import annotations

import torch

from shardmoe.expert_kinds import ExpertKind
from shardmoe.kernels.combine import grad_combine_and_gate_dots
from shardmoe.kernels.down_grad import down_grad
from shardmoe.kernels.forward_gemm import forward_gemm
from shardmoe.kernels.grad_gemm import grad_gemm
from shardmoe.kernels.weight_grad import weight_and_bias_grad


def expert_forward(kind: ExpertKind, activation, output_activation: str, xs: torch.Tensor,
                   params: dict[str, torch.Tensor | None], groups, *, row_index=None):
    """y [N, H] and the tensors backward keeps, kind.saved(pre, z2) (GLU: (h,); MLP: (z1, z2)).

    GLU: h = x Wgu_e^T + bgu_e and a = act(hg) hu (or the clamped SwiGLU's a) in one GEMM;
         y = a Wdown_e^T + bdown_e.
    MLP: z1 = x W1_e^T + b1, a1 = act(z1) in one GEMM; z2 = a1 W2_e^T + b2 and
         y = act_out(z2) in the next (y is z2 itself for an identity act_out, as GLU's always is).
    With row_index [N], xs is the token-order [S, H] tensor and the first GEMM gathers its rows."""
    down, bias = params[kind.down], params.get(kind.down_bias)
    act = xs.new_empty((groups.num_rows, down.shape[2]))
    pre = forward_gemm(xs, params[kind.up], groups, a_index=row_index, bias=params.get(kind.up_bias),
                       activation=activation, glu=kind.gated, post=act)
    if output_activation == "identity":
        z2 = forward_gemm(act, down, groups, bias=bias)
        return z2, kind.saved(pre, z2)
    y = act.new_empty((act.shape[0], down.shape[1]))
    z2 = forward_gemm(act, down, groups, bias=bias, activation=output_activation, post=y)
    return y, kind.saved(pre, z2)


def glu_expert_backward(grad_rows: torch.Tensor, weight_rows: torch.Tensor, xs: torch.Tensor, h: torch.Tensor,
                        params: dict[str, torch.Tensor | None], groups, activation, *, row_index=None):
    """Stages 2-4 for "glu": (dx rows [N, H], gate dots dw [N] float32, {parameter: gradient}).

      down_grad   dh = dSwiGLU(w g Wdown_e, h) [N, 2F], a' = w a [N, F], dw = (g Wdown_e) . a
                  (+ g . bdown_e): one GEMM and its epilogue (down_grad.py)
      dWdown_e  = sum g^T a'  [E, H, F]     dbdown_e = sum w g  [E, H]       (weight_and_bias_grad)
      dWgu_e    = sum dh^T x  [E, 2F, H]    dbgu_e   = sum dh   [E, 2F]      (weight_and_bias_grad)
      dx        = dh Wgu_e    [N, H]                                          (grad_gemm)

    With row_index [N], grad_rows and xs are the token-order [S, H] tensors, read through it. The
    bias gradients come with gate_up_proj_bias; the dots' g . bdown_e term with down_proj_bias
    (expert tensor parallelism passes it None and adds that term itself, after its psum of the
    partial dots over 't')."""
    down, down_bias = params["down_proj"], params.get("down_proj_bias")
    has_bias = params.get("gate_up_proj_bias") is not None
    grad_h, a_scaled, grad_dots = down_grad(grad_rows, weight_rows, h, down, groups, activation,
                                            grad_index=row_index, dot_bias=down_bias)
    grad_down, grad_down_bias = weight_and_bias_grad(grad_rows, a_scaled, groups, grad_index=row_index,
                                                     with_bias=has_bias, bias_scale=weight_rows if has_bias else None)
    del a_scaled
    gate_up = params["gate_up_proj"]
    grad_gate_up, grad_gate_up_bias = weight_and_bias_grad(grad_h, xs, groups, x_index=row_index,
                                                           with_bias=has_bias)
    grad_xs = grad_gemm(grad_h, gate_up, groups)
    return grad_xs, grad_dots, {"gate_up_proj": grad_gate_up, "gate_up_proj_bias": grad_gate_up_bias,
                                "down_proj": grad_down, "down_proj_bias": grad_down_bias}


def mlp_expert_backward(grad_rows: torch.Tensor, weight_rows: torch.Tensor, xs: torch.Tensor, z1: torch.Tensor,
                        z2: torch.Tensor, a1: torch.Tensor, params: dict[str, torch.Tensor | None], groups,
                        activation: str, output_activation: str, *, row_index=None):
    """Stages 1-4 for "mlp": (dx rows [N, H], gate dots dw [N] float32, {parameter: gradient}).

      combine.grad_combine_and_gate_dots  dz2 = w g act_out'(z2) [N, H], dw = g . act_out(z2): one pass
      dz1      = (dz2 W2_e) act'(z1)  [N, P]   the derivative in the GEMM's epilogue (grad_gemm)
      dW2_e    = sum dz2^T a1, db2_e = sum dz2;  dW1_e = sum dz1^T x, db1_e = sum dz1   (weight_and_bias_grad)
      dx       = dz1 W1_e  [N, H]

    Every GEMM reads plain operands: each derivative is applied once, where its tensor is made.
    a1 = act(z1) [N, P] is the caller's (TritonOps recomputes it in torch). With row_index [N],
    grad_rows and xs are the token-order [S, H] tensors, read through it."""
    has_bias = params["b1"] is not None
    grad_z2, grad_dots = grad_combine_and_gate_dots(grad_rows, z2, weight_rows, output_activation=output_activation,
                                                    row_index=row_index)
    w1, w2 = params["w1"], params["w2"]
    grad_z1 = grad_gemm(grad_z2, w2, groups, z=z1, activation=activation)
    grad_w2, grad_b2 = weight_and_bias_grad(grad_z2, a1, groups, with_bias=has_bias)
    del grad_z2
    grad_w1, grad_b1 = weight_and_bias_grad(grad_z1, xs, groups, x_index=row_index, with_bias=has_bias)
    grad_xs = grad_gemm(grad_z1, w1, groups)
    return grad_xs, grad_dots, {"w1": grad_w1, "b1": grad_b1, "w2": grad_w2, "b2": grad_b2}
