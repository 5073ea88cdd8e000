"""The plain-autograd MoE: the oracle every fused-path test is measured against.

This module is written for obviousness, not speed, and shares no code with the
fused path (routing.py, experts.py, function.py): routing is computed with
torch's softmax/topk and a Python capacity loop, experts with
torch.nn.functional, and every gradient comes from autograd. Run it in
float64 and its round-off (~1e-16 relative) is far below the 1e-10 bar the
fused path is held to.

Shapes: S tokens (all leading dims of x flattened), H hidden, E experts, k top-k,
F ("glu") or P ("mlp") expert intermediate size.

Per token t (design.md section 4):
    logits_t = x_t @ Wg                                   [E]
    p_t      = softmax(logits_t)       (float32 for fp32/bf16 inputs, float64 for float64)
    sel_t    = topk(p_t, k)                               [k]
    w_tj     = p_tj / sum_{i in sel_t} p_ti   if renormalize else p_tj
    out_t    = sum_{j in sel_t, (t, j) kept} w_tj * expert_j(x_t)
An expert keeps its first EC = ceil(S / E * capacity_factor * k) tokens in
token order (all tokens when capacity_factor is None).

Aux loss (weighted):  aux_loss_coef * LB + z_loss_coef * Z with
    LB = E * sum_e f_e * P_e,   f_e = (number of top-k selections of e) / S,
                                P_e = mean_t p_te
    Z  = mean_t logsumexp(logits_t)^2
LB is the value of transformers' Mixtral `load_balancing_loss_func` on the same
logits: f_e counts every selection (dropped or not) and is NOT divided by k,
so perfectly uniform routing gives LB = k; the sum is multiplied by E. f_e is a
count and carries no gradient; the gradient flows through P_e only. With S = 0
both means are taken as 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardmoe.moe.config import MoEConfig

# Activations by config name, straight from torch.nn.functional.
ACTIVATION_FUNCTIONS = {
    "relu": F.relu,
    "gelu": lambda z: F.gelu(z, approximate="none"),
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "identity": lambda z: z,
}


def parameter_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of a layer with this config (unsharded)."""
    H, I, E = config.hidden_size, config.ffn_size, config.num_experts
    shapes: dict[str, tuple[int, ...]] = {"gate_weight": (H, E)}
    if config.expert == "glu":
        shapes["gate_up_proj"] = (E, 2 * I, H)
        if config.bias:
            shapes["gate_up_proj_bias"] = (E, 2 * I)
        shapes["down_proj"] = (E, H, I)
        if config.bias:
            shapes["down_proj_bias"] = (E, H)
    else:
        shapes["w1"] = (E, I, H)
        if config.bias:
            shapes["b1"] = (E, I)
        shapes["w2"] = (E, H, I)
        if config.bias:
            shapes["b2"] = (E, H)
    return shapes


def routing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax and the routing weights are computed in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Routing:
    """Routing of S tokens; see the module docstring for the formulas.

    logits [S, E] and probs [S, E] in routing_dtype; selected [S, k] expert ids
    in descending probability; weights [S, k] the (renormalised) combine
    weights; kept [S, k] bool, False where the pair was dropped by capacity.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    selected: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """[E] number of kept (token, expert) pairs per expert."""
        E = self.probs.shape[-1]
        return torch.bincount(self.selected[self.kept], minlength=E)

    @property
    def dropped_pairs(self) -> int:
        """Number of selected (token, expert) pairs dropped by capacity."""
        return int((~self.kept).sum())


def _capacity_mask(selected: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """kept[t, i]: whether expert selected[t, i] still had room when token t arrived.

    Tokens are visited in order; a token selects an expert at most once, so
    "first EC tokens" and "first EC pairs" coincide.
    """
    kept = torch.ones(selected.shape, dtype=torch.bool)
    if capacity is None:
        return kept
    load = [0] * num_experts
    for t, row in enumerate(selected.tolist()):
        for i, e in enumerate(row):
            kept[t, i] = load[e] < capacity
            load[e] += 1
    return kept


def reference_routing(x: torch.Tensor, gate_weight: torch.Tensor, config: MoEConfig) -> Routing:
    """Route tokens x [..., H] with gate_weight [H, E]; differentiable in both."""
    x2 = x.reshape(-1, config.hidden_size)
    # The logits GEMM runs in the input dtype; softmax is then done in the routing dtype.
    logits = (x2 @ gate_weight.to(x2.dtype)).to(routing_dtype(x.dtype))
    probs = torch.softmax(logits, dim=-1)
    top_probs, selected = torch.topk(probs, config.top_k, dim=-1)
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True) if config.renormalize else top_probs
    kept = _capacity_mask(selected, config.num_experts, config.capacity(x2.shape[0])).to(x.device)
    return Routing(logits, probs, selected, weights, kept)


def expert_forward(x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig, e: int) -> torch.Tensor:
    """Expert e on tokens x [n, H] -> [n, H], in x's dtype.

    glu: (act(x Wgate_e^T + bgate_e) * (x Wup_e^T + bup_e)) Wdown_e^T + bdown_e, Wgate_e/Wup_e = rows
         [0:F]/[F:2F] of gate_up_proj[e] (bgate_e/bup_e the same halves of gate_up_proj_bias[e]; biases
         only with config.bias).
    mlp: act_out(act(x W1_e^T + b1_e) W2_e^T + b2_e).
    """
    act = ACTIVATION_FUNCTIONS[config.activation]
    if config.expert == "glu":
        w_gate, w_up = params["gate_up_proj"][e].split(config.ffn_size, dim=0)
        b_gate, b_up, b_down = None, None, None
        if config.bias:
            b_gate, b_up = params["gate_up_proj_bias"][e].split(config.ffn_size, dim=0)
            b_down = params["down_proj_bias"][e]
        return F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), params["down_proj"][e], b_down)
    act_out = ACTIVATION_FUNCTIONS[config.output_activation]
    b1 = params["b1"][e] if config.bias else None
    b2 = params["b2"][e] if config.bias else None
    return act_out(F.linear(act(F.linear(x, params["w1"][e], b1)), params["w2"][e], b2))


def reference_aux_loss(routing: Routing, config: MoEConfig) -> torch.Tensor:
    """aux_loss_coef * LB + z_loss_coef * Z (module docstring); a scalar in the routing dtype."""
    S, E = routing.probs.shape
    # Means over zero tokens are taken as 0; max(S, 1) keeps the graph connected.
    denom = max(S, 1)
    counts = torch.bincount(routing.selected.reshape(-1), minlength=E).to(routing.probs.dtype)
    load_balancing = E * torch.sum(counts / denom * routing.probs.sum(dim=0) / denom)
    z_loss = torch.logsumexp(routing.logits, dim=-1).square().sum() / denom
    return config.aux_loss_coef * load_balancing + config.z_loss_coef * z_loss


def reference_moe(x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(output with x's shape and dtype, weighted aux loss scalar in the routing dtype).

    x [..., H]; params by layer parameter name (parameter_shapes). Differentiable
    in x and every parameter through plain autograd.
    """
    x2 = x.reshape(-1, config.hidden_size)
    routing = reference_routing(x2, params["gate_weight"], config)
    out = torch.zeros(x2.shape, dtype=routing.weights.dtype, device=x.device)
    for e in range(config.num_experts):
        tokens, slots = torch.nonzero((routing.selected == e) & routing.kept, as_tuple=True)
        if tokens.numel() == 0:
            continue
        y = expert_forward(x2[tokens], params, config, e)
        out = out.index_add(0, tokens, routing.weights[tokens, slots, None] * y)
    return out.to(x.dtype).reshape(x.shape), reference_aux_loss(routing, config)


def reference_forward_backward(
    x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(output, aux loss, grads) for the loss L = sum(output * grad_out) + aux loss.

    grads has key "x" for dL/dx and each parameter name for dL/dparam, each
    with its tensor's shape; a tensor the loss does not reach gets zeros.
    Inputs are not modified (detached copies are differentiated).
    """
    leaves = {"x": x.detach().clone().requires_grad_(True)}
    leaves.update({name: p.detach().clone().requires_grad_(True) for name, p in params.items()})
    out, aux = reference_moe(leaves["x"], {n: leaves[n] for n in params}, config)
    loss = (out * grad_out.to(out.dtype)).sum() + aux.to(out.dtype)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    named = {name: torch.zeros_like(leaf) if g is None else g for (name, leaf), g in zip(leaves.items(), grads)}
    return out.detach(), aux.detach(), named


def reference_grads(x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of sum(output * grad_out) + aux loss wrt "x" and every parameter name."""
    return reference_forward_backward(x, params, config, grad_out)[2]

