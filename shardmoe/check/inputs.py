"""Random inputs on which a gradient comparison is well posed.

The MoE output is piecewise smooth: it jumps where two experts tie for the
k-th place, and relu's derivative jumps at 0. Near such a point a tiny
perturbation (a finite-difference step, or bf16 round-off) changes which
branch is taken, and two correct implementations disagree by O(1). Random
inputs hit an exact tie with probability zero, but comparing a bf16 layer with
a float64 reference needs the inputs to stay clear of every branch point by
more than the round-off, so inputs are redrawn until

  logits_t[k-th largest] - logits_t[(k+1)-th largest] >= ROUTING_MARGIN   for every token t
  |u| >= KINK_MARGIN for every relu input u of a kept pair
      (glu: hg = x Wgate^T + bgate; mlp: z1 with activation relu, z2 with output activation relu)
  |hg - L|, ||hu| - L| >= KINK_MARGIN for the clamped SwiGLU's limit L (its clamps' kinks)

with margins per compute dtype. A router other than the plain softmax one selects on
scores (plus a correction bias, within groups), so its margin is measured there: the k-th and
(k+1)-th choice among the allowed experts and the topk_group-th and next group score are at
least SCORE_MARGIN apart; values tied exactly (a tie case's twin experts, decided by index in
every dtype alike) count as one, measured against their distinct neighbours.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardmoe.check.cases import CheckCase
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.reference import ACTIVATION_FUNCTIONS, Routing, parameter_shapes, reference_routing

# Smallest allowed distance to a branch point, per compute dtype: above the forward's
# round-off in that dtype (bf16 logits err by ~1e-2; a bf16-rounded a1 moves z2 by ~5e-3)
# and above a float64 finite-difference step (1e-6), yet small enough to redraw rarely.
ROUTING_MARGIN = {torch.float64: 1e-4, torch.float32: 1e-3, torch.bfloat16: 1e-1}
KINK_MARGIN = {torch.float64: 1e-5, torch.float32: 1e-4, torch.bfloat16: 2e-2}
# Scores move by at most a quarter of their logits' error (sigmoid' <= 1/4, p (1 - p) <= 1/4).
SCORE_MARGIN = {dtype: margin / 4 for dtype, margin in ROUTING_MARGIN.items()}
MAX_DRAWS = 500
CORRECTION_BIAS_STD = 0.1
# Forcing an expert empty: every token gets this much of feature 0, and the empty
# expert's gate column this much negative weight on it, so its logit sits ~9 below the rest.
EMPTY_OFFSET = 3.0


@dataclass
class CaseInputs:
    """x [*tokens_shape, H], params by layer name, grad_out like x; all in one dtype.
    correction_bias [E] float32 (the layer's buffer) or None."""

    x: torch.Tensor
    params: dict[str, torch.Tensor]
    grad_out: torch.Tensor
    correction_bias: torch.Tensor | None = None

    def to(self, dtype: torch.dtype) -> "CaseInputs":
        return CaseInputs(self.x.to(dtype), {n: p.to(dtype) for n, p in self.params.items()},
                          self.grad_out.to(dtype), self.correction_bias)


def _draw(case: CheckCase, generator: torch.Generator) -> CaseInputs:
    """x ~ N(0, 1), matrices ~ N(0, 1/fan_in), expert biases ~ N(0, 0.1^2), gate_bias ~ N(0, 1/E),
    correction_bias ~ N(0, 0.1^2) in float32, grad_out ~ N(0, 1)."""
    config = case.config
    H = config.hidden_size

    def normal(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    params = {}
    for name, shape in parameter_shapes(config).items():
        if name in ("b1", "b2", "gate_up_proj_bias", "down_proj_bias"):
            params[name] = 0.1 * normal(*shape)
        else:
            fan_in = H if name == "gate_weight" else shape[-1]
            params[name] = normal(*shape) / math.sqrt(fan_in)
    x = normal(*case.tokens_shape, H)
    if case.empty_expert is not None:
        x[..., 0] += EMPTY_OFFSET
        params["gate_weight"][0, case.empty_expert] = -EMPTY_OFFSET
    grad_out = normal(*case.tokens_shape, H)
    correction_bias = None
    if config.correction_bias:
        correction_bias = (CORRECTION_BIAS_STD * normal(config.num_experts)).float()
    if case.tie:
        params["gate_weight"][:, 1] = params["gate_weight"][:, 0]
        if "gate_bias" in params:
            params["gate_bias"][1] = params["gate_bias"][0]
        if correction_bias is not None:
            correction_bias[1] = correction_bias[0]
    return CaseInputs(x, params, grad_out, correction_bias)


def _boundary_gap(values: list[float], k: int) -> float:
    """How far values [n] are from changing which k are the largest (ties decided by index): the
    gap between the k-th and (k+1)-th largest or, when those are equal, between that value and its
    nearest distinct neighbours. inf when k >= n."""
    if k >= len(values):
        return math.inf
    ordered = sorted(values, reverse=True)
    if ordered[k - 1] != ordered[k]:
        return ordered[k - 1] - ordered[k]
    tied = ordered[k]
    others = [abs(v - tied) for v in ordered if v != tied]
    return min(others, default=math.inf)


def _selection_gap(config: MoEConfig, routing: Routing, correction_bias: torch.Tensor | None) -> float:
    """Smallest _boundary_gap of the group and expert selections over tokens (module docstring)."""
    choice = routing.probs.detach()
    if correction_bias is not None:
        choice = choice + correction_bias.to(choice.dtype)
    size, gap = config.num_experts // config.n_group, math.inf
    for values in choice.tolist():
        groups = [sum(sorted(values[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(config.n_group)]
        gap = min(gap, _boundary_gap(groups, config.topk_group))
        kept_groups = sorted(range(config.n_group), key=lambda g: (-groups[g], g))[: config.topk_group]
        allowed = [values[e] for g in kept_groups for e in range(g * size, (g + 1) * size)]
        gap = min(gap, _boundary_gap(allowed, config.top_k))
    return gap


def _plain_router(config: MoEConfig) -> bool:
    """Softmax top-k on the logits alone, the router whose margin is measured on logits."""
    return (config.score_func == "softmax" and not config.router_bias and not config.correction_bias
            and config.n_group == 1)


def _routing_gap(config: MoEConfig, x: torch.Tensor, gate_weight: torch.Tensor) -> float:
    """Smallest gap between the k-th and (k+1)-th logit over tokens x [S, H]; inf if k = E or S = 0."""
    if config.top_k == config.num_experts or x.shape[0] == 0:
        return math.inf
    ordered = (x @ gate_weight).sort(dim=-1, descending=True).values
    return (ordered[:, config.top_k - 1] - ordered[:, config.top_k]).min().item()


def _kink_distances(config: MoEConfig, x: torch.Tensor, params: dict[str, torch.Tensor],
                    e: int) -> list[torch.Tensor]:
    """Distances of expert e's activation inputs on tokens x [n, H] to their kinks (float64): every
    relu input u itself (its kink at 0), and for the clamped SwiGLU hg - L, |hu| - L."""
    if config.expert == "glu":
        h = x @ params["gate_up_proj"][e].T + (params["gate_up_proj_bias"][e] if config.bias else 0)
        gate, up = h[:, : config.ffn_size], h[:, config.ffn_size:]
        if config.activation == "clamped_swiglu":
            return [gate - config.swiglu_limit, up.abs() - config.swiglu_limit]
        return [gate] if config.activation == "relu" else []
    z1 = x @ params["w1"][e].T + (params["b1"][e] if config.bias else 0)
    a1 = ACTIVATION_FUNCTIONS[config.activation](z1)
    z2 = a1 @ params["w2"][e].T + (params["b2"][e] if config.bias else 0)
    return [z for z, act in ((z1, config.activation), (z2, config.output_activation)) if act == "relu"]


def _kink_gap(config: MoEConfig, inputs: CaseInputs, routing: Routing) -> float:
    """Smallest distance to a kink (relu, clamp) over the kept pairs of `routing`; inf when none applies."""
    x = inputs.x.reshape(-1, config.hidden_size)
    tokens, slots = routing.kept.nonzero(as_tuple=True)
    experts = routing.selected[tokens, slots]
    gap = math.inf
    for e in range(config.num_experts):
        for u in _kink_distances(config, x[tokens[experts == e]], inputs.params, e):
            if u.numel():
                gap = min(gap, u.abs().min().item())
    return gap


def make_inputs(case: CheckCase, dtype: torch.dtype = torch.float64) -> CaseInputs:
    """Inputs for `case`, drawn in float64 from case.seed, rounded to `dtype`.

    The distances to branch points are measured on the rounded values (what
    both the layer in `dtype` and the float64 reference upcast from them see).
    Raises if no draw within MAX_DRAWS is clear of them with the empty expert
    (if any) receiving no token.
    """
    generator = torch.Generator().manual_seed(case.seed)
    for _ in range(MAX_DRAWS):
        inputs = _draw(case, generator).to(dtype).to(torch.float64)
        x = inputs.x.reshape(-1, case.config.hidden_size)
        plain = _plain_router(case.config)
        if plain and _routing_gap(case.config, x, inputs.params["gate_weight"]) < ROUTING_MARGIN[dtype]:
            continue
        routing = reference_routing(x, inputs.params["gate_weight"], case.config, inputs.params.get("gate_bias"),
                                    inputs.correction_bias)
        if not plain and _selection_gap(case.config, routing, inputs.correction_bias) < SCORE_MARGIN[dtype]:
            continue
        if _kink_gap(case.config, inputs, routing) < KINK_MARGIN[dtype]:
            continue
        if case.empty_expert is not None and (routing.selected == case.empty_expert).any():
            continue
        return inputs.to(dtype)
    raise RuntimeError(f"{case.name}: none of {MAX_DRAWS} input draws kept clear of top-k ties and kinks (relu, clamp) "
                       f"(margins {ROUTING_MARGIN[dtype]}, {KINK_MARGIN[dtype]} for {dtype})")
