"""Shared experts: an always-on dense GLU expert beside the routed ones (DeepSeek-V2/V3, Qwen2-MoE).

Every token t goes through it. With x [S, H], shared_gate_up_proj Wsgu [2Fs, H] (rows 0:Fs gate,
Fs:2Fs up, the routed glu layout), shared_down_proj Wsd [H, Fs] and, with shared_gate,
shared_gate_weight ws [H]:

  h   = x Wsgu^T = [hg | hu]          [S, 2Fs]
  a   = act(hg) * hu                  [S, Fs]    (the layer's activation)
  z   = a Wsd^T                       [S, H]
  s_t = sigmoid(x_t . ws)             [S]        (Qwen2-MoE's shared_expert_gate; 1 without the gate)
  out_t += s_t z_t                               (added to the routed combine, in the acc dtype)

DeepSeek's n_shared always-on experts of width I are one of width Fs = n_shared * I: concatenating
their intermediate dims gives the same sum. The shared expert is the routed glu expert with a single
group holding every token and s_t as its combine weight, so its forward and backward are the routed
experts' own stage functions (moe/experts.py) on Groups of one:

  stage 3 (grad_post_gemm_glu)  g_down = g Wsd [S, Fs];  dA = s g_down;  dWsd = sum_t (s_t g_t)^T a_t
  stage 2 (grad_gate_combine)   ds_t = g_t . z_t = g_down_t . a_t            (gate only)
  stage 4 (grad_pre_gemm_glu)   dh = [dA hu act'(hg) | dA act(hg)];  dWsgu = dh^T x;  dx += dh Wsgu
  gate                          dl_t = ds_t s_t (1 - s_t);  dws = x^T dl [H];  dx_t += dl_t ws

and dx adds into the same input gradient as stage 5's. With the intermediate dim split over 't'
(expert TP), z, ds and the stage-4 dx are partial sums over 't': the caller reduces them between
shared_forward and shared_output, and between shared_backward and shared_gate_backward.
Saved for backward: h [S, 2Fs] (input dtype) and s [S] (acc dtype; ones without the gate).
"""
from __future__ import annotations

import torch

from shardmoe.expert_kinds import GLU
from shardmoe.moe import experts as ex
from shardmoe.moe.combine import grad_gate_combine
from shardmoe.moe.config import MoEConfig
from shardmoe.rows import accumulation_dtype

GATE_NAME = "shared_gate_weight"


def shared_param_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Whole (unsharded) shape of each shared parameter."""
    H, Fs = config.hidden_size, config.shared_ffn_size
    shapes = {"shared_gate_up_proj": (2 * Fs, H), "shared_down_proj": (H, Fs), GATE_NAME: (H,)}
    return {n: shapes[n] for n in config.shared_param_names}


def _one_group(num_tokens: int, device) -> ex.Groups:
    return ex.Groups.from_counts(torch.tensor([num_tokens], device=device), num_rows=num_tokens)


def shared_gate(x: torch.Tensor, gate_weight: torch.Tensor | None) -> torch.Tensor:
    """s = sigmoid(x ws) [S] in the acc dtype, or ones [S] without the gate."""
    acc = accumulation_dtype(x.dtype)
    if gate_weight is None:
        return torch.ones(x.shape[0], dtype=acc, device=x.device)
    return torch.sigmoid(x.to(acc) @ gate_weight.to(acc))


def shared_forward(ops, x: torch.Tensor, params: dict, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(z = (act(hg) * hu) Wsd^T [S, H] in x's dtype, h [S, 2Fs]) for tokens x [S, H]; z is a partial
    sum over 't' when the intermediate dim is sharded."""
    groups = _one_group(x.shape[0], x.device)
    gate_up, down = params["shared_gate_up_proj"][None], params["shared_down_proj"][None]
    a, h = ex.pre_gemm(ops, GLU, activation, x, {"gate_up_proj": gate_up}, groups)
    z, _ = ex.post_gemm(ops, GLU, "identity", a, {"down_proj": down}, groups)
    return z, h


def shared_output(ops, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """s_t z_t [S, H] in the acc dtype (rounded once with the routed output by the caller)."""
    return ops.scale_rows(z.to(s.dtype), s)


def shared_backward(ops, grad_out: torch.Tensor, x: torch.Tensor, h: torch.Tensor, s: torch.Tensor, params: dict,
                    activation: str, gated: bool):
    """Stages 3, 2, 4 of the shared expert for the output gradient g [S, H]:
    (dx [S, H], ds [S] acc dtype or None without the gate, {name: gradient}). dx and ds are partial
    sums over 't' when the intermediate dim is sharded; the weight gradients are this rank's slice."""
    groups = _one_group(x.shape[0], x.device)
    gate_up, down = params["shared_gate_up_proj"][None], params["shared_down_proj"][None]
    a, act_gate = ex.glu_activation(ops, h, activation)
    grad_a, grad_down, g_down, _ = ex.grad_post_gemm_glu(ops, grad_out, s, a, down, groups)
    grad_dot = grad_gate_combine(ops, g_down, act_gate, h[:, act_gate.shape[1]:]) if gated else None
    grad_x, grad_gate_up, _ = ex.grad_pre_gemm_glu(ops, grad_a, h, act_gate, x, gate_up, groups, activation)
    return grad_x, grad_dot, {"shared_gate_up_proj": grad_gate_up[0], "shared_down_proj": grad_down[0]}


def shared_gate_backward(x: torch.Tensor, s: torch.Tensor, grad_dot: torch.Tensor,
                         gate_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's part, from the whole ds = g . z [S]: (dx [S, H], dws [H]), both in the acc dtype."""
    acc = s.dtype
    grad_logit = grad_dot.to(acc) * s * (1 - s)
    return grad_logit[:, None] * gate_weight.to(acc), x.to(acc).t() @ grad_logit


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def forward(ops, x: torch.Tensor, params: dict, config: MoEConfig,
            reduce_output=_whole) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(s z [S, H] acc dtype, saved (h, s)) on the row primitives `ops` (the forward's, dispatch.select).
    reduce_output sums z over 't' under expert TP (the intermediate dim is sharded there); one
    process needs none."""
    s = shared_gate(x, params.get(GATE_NAME))
    z, h = shared_forward(ops, x, params, config.activation)
    return shared_output(ops, reduce_output(z), s), (h, s)


def backward(ops, grad_out: torch.Tensor, x: torch.Tensor, saved: tuple, params: dict, config: MoEConfig,
             reduce_input=_whole, reduce_dot=_whole) -> tuple[torch.Tensor, dict]:
    """(dx [S, H] acc dtype, {name: gradient in the parameter's dtype}, this rank's slices under
    expert TP). reduce_input and reduce_dot sum the partial dx [S, H] and ds [S] over 't' there:
    ds must be whole before the sigmoid Jacobian."""
    h, s = saved
    gate = params.get(GATE_NAME)
    grad_x, grad_dot, grads = shared_backward(ops, grad_out, x, h, s, params, config.activation, gate is not None)
    grad_x = reduce_input(grad_x).to(s.dtype)
    if gate is not None:
        grad_x_gate, grads[GATE_NAME] = shared_gate_backward(x, s, reduce_dot(grad_dot), gate)
        grad_x = grad_x + grad_x_gate
    return grad_x, {n: grads[n].to(params[n].dtype) for n in config.shared_param_names}
