"""Wrappers that replace shardmoe/moe/experts.py's stage functions on CUDA tensors.

Each function has the name, positional signature and semantics of its counterpart in
shardmoe.moe.experts, so a stage function can hand its arguments over unchanged when
the Triton backend (shardmoe/moe/backends.py) is chosen. Extra keyword-only arguments switch on
fusions the torch path cannot express:

  row_index   [N] int: the rows argument is the token-order matrix ([S, H]: x or
              grad_out) and row r reads row row_index[r] inside the kernel, so the
              gathered copy x[row_token] / grad_out[row_token] is never made.

Two entry points fuse across stages and have no single torch counterpart:
expert_forward_combine (expert forward + combine) and grad_gate_post_gemm_glu
(stages 2 and 3 of the "glu" expert). Outputs are in the input dtype (float32
accumulation inside), as in the torch path.

Every expert kind of the torch path runs here: "glu" with or without its biases
(gate_up_proj_bias [E, 2F], down_proj_bias [E, H]) and with an activation name or a
clamped SwiGLU (activations.activation_args), "mlp" with or without b1, b2. The entry points
take the kind (shardmoe/expert_kinds.py, a leaf), which names the parameters and says what the
forward saves.
"""
from __future__ import annotations

import torch

from shardmoe.expert_kinds import ExpertKind
from shardmoe.kernels.forward_gemm import forward_gemm
from shardmoe.kernels.grad_gemm import grad_gemm
from shardmoe.kernels.weight_grad import bias_grad, weight_grad
from shardmoe.rows import accumulation_dtype


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, groups, *, row_index=None) -> torch.Tensor:
    """out_r = rows_r W_e^T: rows [N, K], weight [E, O, K] -> [N, O]."""
    return forward_gemm(rows, weight, groups, a_index=row_index)


def grouped_linear_t(rows: torch.Tensor, weight: torch.Tensor, groups) -> torch.Tensor:
    """out_r = rows_r W_e: rows [N, O], weight [E, O, K] -> [N, K]."""
    return grad_gemm(rows, weight, groups)[0]


def grouped_weight_grad(grad_rows: torch.Tensor, in_rows: torch.Tensor, groups) -> torch.Tensor:
    """dW_e = sum over rows r of e of grad_r^T in_r: [N, O], [N, K] -> [E, O, K]."""
    return weight_grad(grad_rows, in_rows, groups, width=grad_rows.shape[1])[0]


def grouped_bias_grad(grad_rows: torch.Tensor, groups) -> torch.Tensor:
    """db_e = sum over rows r of e of grad_r: [N, O] -> [E, O]."""
    return bias_grad(grad_rows, groups)


def _expert_up(kind, activation, xs, params, groups, row_index):
    """First GEMM with the bias and the activation in its epilogue: (saved pre-activation, activation)."""
    act = xs.new_empty((sum(groups.sizes), params[kind.down].shape[2]))
    pre = forward_gemm(xs, params[kind.up], groups, a_index=row_index, bias=params.get(kind.up_bias),
                       activation=activation, glu=kind.gated, post=act)
    return pre, act


def expert_forward(kind: ExpertKind, activation, output_activation: str, xs: torch.Tensor,
                   params: dict[str, torch.Tensor | None], groups, *, row_index=None):
    """y [N, H] and the tensors backward keeps, kind.saved(pre, z2) (GLU: (h,); MLP: (z1, z2)).

    GLU: h = x Wgu_e^T + bgu_e and a = act(hg) hu (or the clamped SwiGLU's a) in one GEMM;
         y = a Wdown_e^T + bdown_e.
    MLP: z1 = x W1_e^T + b1, a1 = act(z1) in one GEMM; z2 = a1 W2_e^T + b2 and
         y = act_out(z2) in the next (y is z2 itself for an identity act_out, as GLU's always is)."""
    pre, act = _expert_up(kind, activation, xs, params, groups, row_index)
    down, bias = params[kind.down], params.get(kind.down_bias)
    if output_activation == "identity":
        z2 = forward_gemm(act, down, groups, bias=bias)
        return z2, kind.saved(pre, z2)
    y = act.new_empty((act.shape[0], down.shape[1]))
    z2 = forward_gemm(act, down, groups, bias=bias, activation=output_activation, post=y)
    return y, kind.saved(pre, z2)


def expert_forward_combine(kind: ExpertKind, activation, output_activation: str, x: torch.Tensor,
                           row_token: torch.Tensor, weight_rows: torch.Tensor, row_pair: torch.Tensor,
                           params: dict[str, torch.Tensor | None], groups, top_k: int):
    """The whole expert forward and combine: (out [S, H] acc dtype, saved as expert_forward).

    Equals combine(expert_forward(..., x[row_token], ...)[0], weight_rows, row_pair, S, k).
    The first GEMM gathers x rows by row_token itself; the second writes w_r y_r of each
    kept pair into its slot t * k + j of an [S * k, H] float32 buffer, once, without
    atomics, and the k slots of a token are summed afterwards (a plain reduction over a
    contiguous axis). For top-1 routing the slot buffer is the output. z2 is stored only
    for a kind that saves it (MLP).
    """
    num_tokens = x.shape[0]
    pre, act = _expert_up(kind, activation, x, params, groups, row_token)
    down = params[kind.down]
    fill = torch.zeros if row_pair.numel() < num_tokens * top_k else torch.empty  # dropped slots stay 0
    slots = fill((num_tokens * top_k, down.shape[1]), dtype=accumulation_dtype(x.dtype), device=x.device)
    z2 = forward_gemm(act, down, groups, bias=params.get(kind.down_bias), activation=output_activation,
                      store_pre=kind.keeps_z2, post=slots, scale=weight_rows, dest=row_pair)
    out = slots if top_k == 1 else slots.view(num_tokens, top_k, down.shape[1]).sum(1)  # S = 0 works too
    return out, kind.saved(pre, z2)


def grad_post_gemm_glu(grad_rows: torch.Tensor, weight_rows: torch.Tensor, a: torch.Tensor,
                       down_proj: torch.Tensor, groups, has_bias: bool = False, *, row_index=None):
    """Stage 3 for "glu": (dA = w g Wdown_e [N, F], dWdown_e = sum (w g)^T a [E, H, F],
    g_down = g Wdown_e [N, F], dbdown_e = sum w g [E, H] with has_bias, else None).
    One GEMM writes both g_down and its row-scaled copy; dbdown is summed from the tiles of the
    weight-gradient GEMM."""
    grad_a, g_down, _ = grad_gemm(grad_rows, down_proj, groups, grad_index=row_index, scale=weight_rows,
                                  keep_unscaled=True)
    grad_down, grad_down_bias = weight_grad(grad_rows, a, groups, width=down_proj.shape[1], grad_index=row_index,
                                            scale=weight_rows, with_bias=has_bias)
    return grad_a, grad_down, g_down, grad_down_bias


def grad_gate_post_gemm_glu(grad_rows: torch.Tensor, weight_rows: torch.Tensor, a: torch.Tensor,
                            down_proj: torch.Tensor, groups, down_proj_bias: torch.Tensor | None = None,
                            has_bias: bool = False, *, row_index=None):
    """Stages 2 and 3 for "glu": (dA [N, F], dWdown [E, H, F], dw [N] acc dtype, dbdown [E, H] or None),
    with dw_r = g_r . y_r = (g_r Wdown_e) . a_r (+ g_r . bdown_e with down_proj_bias [E, H]) taken
    in the dA GEMM (the first term in its epilogue, the bias term in its K loop over g), so g_down
    is never stored; dbdown = sum w g per expert with has_bias. has_bias and down_proj_bias are
    separate because expert tensor parallelism adds the dot's bias term itself, after its psum of
    the partial dots, and still wants dbdown. Equals grad_post_gemm_glu followed by
    grad_gate_combine(g_down, a) (+ grad_gate_combine(g, bdown[row expert]))."""
    grad_a, _, grad_weight_rows = grad_gemm(grad_rows, down_proj, groups, grad_index=row_index, scale=weight_rows,
                                            dot_with=a, dot_bias=down_proj_bias)
    grad_down, grad_down_bias = weight_grad(grad_rows, a, groups, width=down_proj.shape[1], grad_index=row_index,
                                            scale=weight_rows, with_bias=has_bias)
    return grad_a, grad_down, grad_weight_rows, grad_down_bias


def grad_pre_gemm_glu(grad_a: torch.Tensor, h: torch.Tensor, act_gate: torch.Tensor, xs: torch.Tensor,
                      gate_up_proj: torch.Tensor, groups, activation, has_bias: bool = False, *, row_index=None):
    """Stage 4 for "glu": (dx = dh Wgu_e [N, H], dWgu_e = sum dh^T x [E, 2F, H], dbgu_e = sum dh [E, 2F]
    with has_bias, else None) with dh = [dA hu act'(hg) | dA act(hg)] (or the clamped SwiGLU's
    derivative) formed in registers from dA and h (fGETGrad).
    act_gate is accepted for signature parity and not read: act(hg) is recomputed in
    float32 from h, cheaper than loading another [N, F] tensor."""
    del act_gate
    grad_x, _, _ = grad_gemm(grad_a, gate_up_proj, groups, z=h, activation=activation, glu=True)
    grad_gate_up, grad_gate_up_bias = weight_grad(grad_a, xs, groups, width=gate_up_proj.shape[1], x_index=row_index,
                                                  z=h, activation=activation, glu=True, with_bias=has_bias)
    return grad_x, grad_gate_up, grad_gate_up_bias


def grad_pre_gemm_given(grad_h: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, groups, has_bias: bool = False,
                        *, row_index=None):
    """Stage 4's two GEMMs on a gradient already formed, dh [N, C] (glu: C = 2F):
    (dx = dh W_e [N, H], dW_e = sum dh^T x [E, C, H], db_e = sum dh [E, C] with has_bias, else None)."""
    grad_x, _, _ = grad_gemm(grad_h, weight, groups)
    grad_w, grad_b = weight_grad(grad_h, xs, groups, width=weight.shape[1], x_index=row_index, with_bias=has_bias)
    return grad_x, grad_w, grad_b


def grad_post_gemm_mlp(grad_expert: torch.Tensor, z2: torch.Tensor, a1: torch.Tensor, w2: torch.Tensor,
                       has_bias: bool, groups, output_activation: str):
    """Stage 3 for "mlp": (da1 = dz2 W2_e [N, P], dW2_e = sum dz2^T a1 [E, H, P], db2 [E, H] or None)
    with dz2 = ge act_out'(z2) formed in registers (fGETGrad)."""
    grad_a1, _, _ = grad_gemm(grad_expert, w2, groups, z=z2, activation=output_activation)
    grad_w2, grad_b2 = weight_grad(grad_expert, a1, groups, width=w2.shape[1], z=z2,
                                   activation=output_activation, with_bias=has_bias)
    return grad_a1, grad_w2, grad_b2


def grad_pre_gemm_mlp(grad_a1: torch.Tensor, z1: torch.Tensor, xs: torch.Tensor, w1: torch.Tensor,
                      has_bias: bool, groups, activation: str, *, row_index=None):
    """Stage 4 for "mlp": (dx = dz1 W1_e [N, H], dW1_e = sum dz1^T x [E, P, H], db1 [E, P] or None)
    with dz1 = da1 act'(z1) formed in registers (fGETGrad)."""
    grad_x, _, _ = grad_gemm(grad_a1, w1, groups, z=z1, activation=activation)
    grad_w1, grad_b1 = weight_grad(grad_a1, xs, groups, width=w1.shape[1], x_index=row_index, z=z1,
                                   activation=activation, with_bias=has_bias)
    return grad_x, grad_w1, grad_b1
