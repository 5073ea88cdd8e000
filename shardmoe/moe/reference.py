"""The plain-autograd MoE: the oracle every layer test is measured against.

This module is written for obviousness, not speed, and shares no code with the
MoE layer (routing.py, experts.py, function.py): routing is computed with
torch's softmax/topk and a Python capacity loop, experts with
torch.nn.functional, and every gradient comes from autograd. Run it in
float64 and its round-off (~1e-16 relative) is far below the 1e-10 bar the
layer is held to.

Shapes: S tokens (all leading dims of x flattened), H hidden, E experts, k top-k,
F ("glu") or P ("mlp") expert intermediate size.

Per token t (the layer's math, docs/moe.md; the router options of docs/moe.md "Routers"):
    logits_t = x_t @ Wg (+ gate_bias)                     [E]
    p_t      = softmax(logits_t) or sigmoid(logits_t)  (float32 for fp32/bf16 inputs, float64 for float64)
    c_t      = p_t + correction_bias                      (selection only, detached)
    groups   = the topk_group groups of E / n_group experts with the largest sums of their two
               best c (ties: lower group); sel_t = the k largest c inside them (ties: lower
               expert), chosen by a Python loop over sorted lists, not by the layer's sort
    w_tj     = factor * p_tj / (sum_{i in sel_t} p_ti + eps)  if renormalize else factor * p_tj
    out_t    = sum_{j in sel_t, (t, j) kept} w_tj * expert_j(x_t)
             + s_t * (act(x_t Wsg^T) * (x_t Wsu^T)) Wsd^T       (shared_ffn_size > 0; Wsg / Wsu the
               halves of shared_gate_up_proj, s_t = sigmoid(x_t . shared_gate_weight) with
               shared_gate, else 1)
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
both means are taken as 0. For sigmoid scores P_e averages p_te / sum_e p_te.
Plus seq_aux_loss_coef * SEQ, DeepSeek-V3's sequence-wise loss, averaged over sequences q:
    SEQ = mean_q sum_e f_qe P_qe,  f_qe = E / (k T_q) * (selections of e in q),
          P_qe = mean_{t in q} p_te / sum_e p_te   (p itself for softmax)
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
    if config.router_bias:
        shapes["gate_bias"] = (E,)
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
    if config.shared_ffn_size:
        shapes["shared_gate_up_proj"] = (2 * config.shared_ffn_size, H)
        shapes["shared_down_proj"] = (H, config.shared_ffn_size)
        if config.shared_gate:
            shapes["shared_gate_weight"] = (H,)
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


def _largest_first(values: list[float], candidates) -> list[int]:
    """candidates ordered by value, largest first; equal values: lower index first."""
    return sorted(candidates, key=lambda i: (-values[i], i))


def _select(choice: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """[S, k] experts chosen on choice [S, E], group-limited, one token at a time."""
    size = config.num_experts // config.n_group
    rows = []
    for values in choice.tolist():
        group_scores = []
        for g in range(config.n_group):
            best = sorted(values[g * size:(g + 1) * size], reverse=True)
            group_scores.append(sum(best[:2]))
        groups = _largest_first(group_scores, range(config.n_group))[: config.topk_group]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        rows.append(_largest_first(values, allowed)[: config.top_k])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, config.top_k)


def reference_routing(x: torch.Tensor, gate_weight: torch.Tensor, config: MoEConfig,
                      gate_bias: torch.Tensor | None = None, correction_bias: torch.Tensor | None = None) -> Routing:
    """Route tokens x [..., H] with gate_weight [H, E] (+ gate_bias [E]); differentiable in those."""
    x2 = x.reshape(-1, config.hidden_size)
    # The logits GEMM runs in the input dtype; the scores are then done in the routing dtype.
    logits = (x2 @ gate_weight.to(x2.dtype)).to(routing_dtype(x.dtype))
    if gate_bias is not None:
        logits = logits + gate_bias.to(logits.dtype)
    probs = torch.softmax(logits, dim=-1) if config.score_func == "softmax" else torch.sigmoid(logits)
    choice = probs.detach()
    if correction_bias is not None:
        choice = choice + correction_bias.to(choice.dtype)
    selected = _select(choice, config).to(x.device)
    top_probs = probs.gather(1, selected)
    if config.renormalize:
        weights = top_probs / (top_probs.sum(dim=-1, keepdim=True) + config.renormalize_epsilon)
    else:
        weights = top_probs
    weights = weights * config.routed_scaling_factor
    kept = _capacity_mask(selected, config.num_experts, config.capacity(x2.shape[0])).to(x.device)
    return Routing(logits, probs, selected, weights, kept)


def expert_forward(x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig, e: int) -> torch.Tensor:
    """Expert e on tokens x [n, H] -> [n, H], in x's dtype.

    glu: (act(x Wgate_e^T + bgate_e) * (x Wup_e^T + bup_e)) Wdown_e^T + bdown_e, Wgate_e/Wup_e = rows
         [0:F]/[F:2F] of gate_up_proj[e] (bgate_e/bup_e the same halves of gate_up_proj_bias[e]; biases
         only with config.bias).
         clamped_swiglu (GPT-OSS): with g, u the two projections, L = swiglu_limit, alpha = swiglu_alpha,
         (clamp(u, -L, L) + 1) * clamp(g, max=L) * sigmoid(alpha * clamp(g, max=L)) in place of act(g) * u.
    mlp: act_out(act(x W1_e^T + b1_e) W2_e^T + b2_e).
    """
    act = ACTIVATION_FUNCTIONS.get(config.activation)
    if config.expert == "glu":
        w_gate, w_up = params["gate_up_proj"][e].split(config.ffn_size, dim=0)
        b_gate, b_up, b_down = None, None, None
        if config.bias:
            b_gate, b_up = params["gate_up_proj_bias"][e].split(config.ffn_size, dim=0)
            b_down = params["down_proj_bias"][e]
        gate, up = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
        if config.activation == "clamped_swiglu":
            gate = gate.clamp(max=config.swiglu_limit)
            up = up.clamp(-config.swiglu_limit, config.swiglu_limit)
            hidden = (up + 1) * (gate * torch.sigmoid(config.swiglu_alpha * gate))
        else:
            hidden = act(gate) * up
        return F.linear(hidden, params["down_proj"][e], b_down)
    act_out = ACTIVATION_FUNCTIONS[config.output_activation]
    b1 = params["b1"][e] if config.bias else None
    b2 = params["b2"][e] if config.bias else None
    return act_out(F.linear(act(F.linear(x, params["w1"][e], b1)), params["w2"][e], b2))


def shared_expert_forward(x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig) -> torch.Tensor:
    """The shared expert on tokens x [S, H] -> [S, H] in the routing dtype (zeros without one):
    s * (act(x Wsg^T) * (x Wsu^T)) Wsd^T, s = sigmoid(x . ws) [S, 1] or 1."""
    if not config.shared_ffn_size:
        return torch.zeros(x.shape, dtype=routing_dtype(x.dtype), device=x.device)
    w_gate, w_up = params["shared_gate_up_proj"].split(config.shared_ffn_size, dim=0)
    act = ACTIVATION_FUNCTIONS[config.activation]
    y = F.linear(act(F.linear(x, w_gate)) * F.linear(x, w_up), params["shared_down_proj"]).to(routing_dtype(x.dtype))
    if not config.shared_gate:
        return y
    gate = torch.sigmoid(x.to(y.dtype) @ params["shared_gate_weight"].to(y.dtype))
    return gate[:, None] * y


def reference_sequences(x: torch.Tensor, sequence_starts=None) -> list[range]:
    """The token ranges of the sequences of x [..., H]: from sequence_starts (offsets into the
    flattened tokens), else one per [T] row of x [..., T, H] (3+ dims), else one."""
    num_tokens = x.numel() // x.shape[-1]
    if sequence_starts is None:
        length = x.shape[-2] if x.dim() >= 3 else num_tokens
        sequence_starts = list(range(0, num_tokens, max(length, 1)))
    bounds = [int(s) for s in sequence_starts] + [num_tokens]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def reference_aux_loss(routing: Routing, config: MoEConfig, sequences: list[range] | None = None) -> torch.Tensor:
    """aux_loss_coef * LB + z_loss_coef * Z + seq_aux_loss_coef * SEQ (module docstring); a scalar
    in the routing dtype. sequences: token ranges (default: all tokens, one sequence)."""
    S, E = routing.probs.shape
    # Means over zero tokens are taken as 0; max(S, 1) keeps the graph connected.
    denom = max(S, 1)
    balance = routing.probs if config.score_func == "softmax" else routing.probs / routing.probs.sum(-1, keepdim=True)
    counts = torch.bincount(routing.selected.reshape(-1), minlength=E).to(routing.probs.dtype)
    load_balancing = E * torch.sum(counts / denom * balance.sum(dim=0) / denom)
    z_loss = torch.logsumexp(routing.logits, dim=-1).square().sum() / denom
    total = config.aux_loss_coef * load_balancing + config.z_loss_coef * z_loss
    sequences = [range(S)] if sequences is None else sequences
    if config.seq_aux_loss_coef and S:
        per_sequence = []
        for q in sequences:
            length = len(q)
            seq_counts = torch.bincount(routing.selected[q.start:q.stop].reshape(-1), minlength=E)
            f = E / (config.top_k * length) * seq_counts.to(balance.dtype)
            per_sequence.append((f * balance[q.start:q.stop].mean(dim=0)).sum())
        total = total + config.seq_aux_loss_coef * torch.stack(per_sequence).mean()
    return total


def reference_moe(x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig,
                  correction_bias: torch.Tensor | None = None, sequence_starts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output with x's shape and dtype, weighted aux loss scalar in the routing dtype).

    x [..., H]; params by layer parameter name (parameter_shapes). Differentiable
    in x and every parameter through plain autograd. correction_bias [E] (a buffer) and
    sequence_starts (reference_sequences) as the layer takes them.
    """
    x2 = x.reshape(-1, config.hidden_size)
    routing = reference_routing(x2, params["gate_weight"], config, params.get("gate_bias"), correction_bias)
    out = torch.zeros(x2.shape, dtype=routing.weights.dtype, device=x.device)
    for e in range(config.num_experts):
        tokens, slots = torch.nonzero((routing.selected == e) & routing.kept, as_tuple=True)
        if tokens.numel() == 0:
            continue
        y = expert_forward(x2[tokens], params, config, e)
        out = out.index_add(0, tokens, routing.weights[tokens, slots, None] * y)
    out = out + shared_expert_forward(x2, params, config)
    sequences = reference_sequences(x, sequence_starts)
    return out.to(x.dtype).reshape(x.shape), reference_aux_loss(routing, config, sequences)


def reference_forward_backward(
    x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig, grad_out: torch.Tensor,
    correction_bias: torch.Tensor | None = None, sequence_starts=None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(output, aux loss, grads) for the loss L = sum(output * grad_out) + aux loss.

    grads has key "x" for dL/dx and each parameter name for dL/dparam, each
    with its tensor's shape; a tensor the loss does not reach gets zeros.
    Inputs are not modified (detached copies are differentiated).
    """
    leaves = {"x": x.detach().clone().requires_grad_(True)}
    leaves.update({name: p.detach().clone().requires_grad_(True) for name, p in params.items()})
    out, aux = reference_moe(leaves["x"], {n: leaves[n] for n in params}, config, correction_bias, sequence_starts)
    loss = (out * grad_out.to(out.dtype)).sum() + aux.to(out.dtype)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    named = {name: torch.zeros_like(leaf) if g is None else g for (name, leaf), g in zip(leaves.items(), grads)}
    return out.detach(), aux.detach(), named


def reference_grads(x: torch.Tensor, params: dict[str, torch.Tensor], config: MoEConfig, grad_out: torch.Tensor,
                    correction_bias: torch.Tensor | None = None, sequence_starts=None) -> dict[str, torch.Tensor]:
    """Gradients of sum(output * grad_out) + aux loss wrt "x" and every parameter name."""
    return reference_forward_backward(x, params, config, grad_out, correction_bias, sequence_starts)[2]

