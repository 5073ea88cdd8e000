"""The "shardmoe" experts implementation behind transformers' experts seam.

transformers 5.x experts classes decorated with `use_experts_implementation` send their forward
to ALL_EXPERTS_FUNCTIONS[config._experts_implementation] as

  f(experts, hidden_states [S, H], top_k_index [S, k], top_k_weights [S, k]) -> [S, H]
  out_t = sum_j w_tj y_{e_tj}(x_t),   w = top_k_weights, e = top_k_index

with the family's own router upstream. `experts_forward` runs that through the fused expert
stages of shardmoe/moe (expert_forward / expert_backward, combine) in one autograd.Function whose
backward is the explicit one: stages 1-5, and stage 2's dots dw_tj = g_t . y_{e_tj}(x_t) are
exactly dL/dtop_k_weights, through which the family's router gets its gradient.

The decorator describes the experts' layout; each is mapped onto shardmoe's canonical one
(glu: gate_up_proj [E, 2F, H] as [gate | up], down_proj [E, H, F]; mlp: w1 [E, P, H], w2 [E, H, P])
by autograd views, so the parameter gradients land in the family's layout:
  is_transposed   gate_up_proj [E, H, 2F], down_proj [E, F, H]: a transpose of the last two dims
  has_bias        gate_up_proj_bias [E, 2F], down_proj_bias [E, H] (up_proj_bias without a gate)
  not has_gate    up_proj -> act_fn -> down_proj: shardmoe's "mlp" expert
How gate and up are laid out is decided by _apply_gate, not by is_concatenated: every
transformers implementation (eager, grouped_mm, batched_mm) calls _apply_gate, and the default
one, act_fn(gate) * up with (gate, up) = chunk(2), reads [gate | up] whatever the flag says
(is_concatenated only steers sonicmoe). An interleaved family has its own _apply_gate: GPT-OSS's
(GptOssExperts: gate, up = h[..., ::2], h[..., 1::2]; (clamp(up, -L, L) + 1) * g sigmoid(alpha g)
with g = min(gate, L)) is shardmoe's ClampedSwiGLU(limit, alpha) on rows reordered from
[g0, u0, g1, u1, ...] to [gate | up] (an autograd copy of gate_up_proj and its bias, so their
gradients land back interleaved). The activation is otherwise identified by the class of act_fn
(one of shardmoe's). Anything else (another family's own _apply_gate, a post-expert norm,
transformers' expert-parallel sentinels) raises ValueError naming the family and the feature
before any work.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardmoe.moe import combine as comb
from shardmoe.moe import experts as ex
from shardmoe.moe.activations import ClampedSwiGLU
from shardmoe.moe.hf_blocks import MIXTRAL_ACTIVATIONS, family_name
from shardmoe.moe.routing import accumulation_dtype, dispatch_order


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module's tensors map onto shardmoe's stage parameters.

    expert "glu" or "mlp"; names: the module's parameters, in the order of the stage parameters
    (glu: gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias; mlp: w1, b1, w2, b2), None
    where the module has none."""

    family: str
    expert: str
    activation: str | ClampedSwiGLU
    names: tuple[str | None, ...]
    transposed: bool
    interleaved: bool = False  # gate_up rows [g0, u0, g1, u1, ...] (GPT-OSS), else [gate | up]

    @property
    def stage_names(self) -> tuple[str, ...]:
        if self.expert == "glu":
            return ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        return ("w1", "b1", "w2", "b2")


def _refuse(experts, feature: str) -> ValueError:
    return ValueError(f"experts: the 'shardmoe' experts implementation cannot run family {family_name(experts)!r} "
                      f"({type(experts).__name__}): {feature}")


def experts_activation(experts) -> str:
    """shardmoe's name for experts.act_fn, read off the module's class (the config field that
    names it differs by family: hidden_act, mlp_hidden_act, ...)."""
    from transformers.activations import ACT2FN  # experts is a transformers module: it is imported

    by_class = {type(ACT2FN[hf]): name for name, hf in [*MIXTRAL_ACTIVATIONS.items(), ("silu", "swish")]}
    act_fn = getattr(experts, "act_fn", None)
    if type(act_fn) not in by_class:
        raise _refuse(experts, f"activation: expected act_fn one of {sorted(c.__name__ for c in by_class)}, "
                               f"got {type(act_fn).__name__}")
    return by_class[type(act_fn)]


def read_layout(experts) -> ExpertsLayout:
    """The layout of a decorated experts module, or ValueError naming its family and the feature."""
    from transformers.integrations.moe import _default_apply_gate

    if not hasattr(experts, "is_transposed"):
        raise _refuse(experts, "expected an experts module decorated with use_experts_implementation "
                               "(no is_transposed / has_gate attributes)")
    if getattr(experts, "has_post_expert_norm", False):
        raise _refuse(experts, "a post-expert norm (has_post_expert_norm=True) is not supported")
    if getattr(experts, "_is_expert_parallel", False):
        raise _refuse(experts, "transformers' expert parallelism (sentinel expert ids) is not supported; "
                               "shardmoe shards experts itself (MoE.from_hf with a mesh)")
    has_bias = bool(experts.has_bias)
    activation, interleaved = None, False
    if experts.has_gate:
        if type(experts)._apply_gate is not _default_apply_gate:
            if type(experts).__name__ != "GptOssExperts":
                raise _refuse(experts, f"its own gate {type(experts).__name__}._apply_gate is not supported (only "
                                       "act(gate) * up and GPT-OSS's clamped SwiGLU are)")
            activation, interleaved = ClampedSwiGLU(float(experts.limit), float(experts.alpha)), True
        names = ("gate_up_proj", "gate_up_proj_bias" if has_bias else None, "down_proj",
                 "down_proj_bias" if has_bias else None)
        expert = "glu"
    else:
        names = ("up_proj", "up_proj_bias" if has_bias else None, "down_proj", "down_proj_bias" if has_bias else None)
        expert = "mlp"
    missing = [n for n in names if n is not None and not isinstance(getattr(experts, n, None), torch.Tensor)]
    if missing:
        raise _refuse(experts, f"expert layout: expected the tensors {[n for n in names if n]}, missing {missing}")
    return ExpertsLayout(family_name(experts), expert, activation or experts_activation(experts), names,
                         bool(experts.is_transposed), interleaved)


def gate_up_halves(t: torch.Tensor) -> torch.Tensor:
    """Interleaved rows [g0, u0, g1, u1, ...] of gate_up [E, 2F, ...] -> [gate | up] (an autograd copy)."""
    E, two_f, *rest = t.shape
    return t.unflatten(1, (two_f // 2, 2)).transpose(1, 2).reshape(E, two_f, *rest)


def gate_up_interleaved(t: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows of [E, 2F, ...] -> interleaved [g0, u0, g1, u1, ...] (inverse of gate_up_halves)."""
    E, two_f, *rest = t.shape
    return t.unflatten(1, (2, two_f // 2)).transpose(1, 2).reshape(E, two_f, *rest)


def stage_parameters(layout: ExpertsLayout, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The module's tensors (in layout.names order) as the stage parameters [E, O, K], by
    differentiable views (the stages take any strides); interleaved gate/up rows are reordered."""
    out = [t.transpose(-2, -1) if layout.transposed and t is not None and t.dim() == 3 else t for t in tensors]
    if layout.interleaved:  # gate_up_proj and its bias are the first two
        out[:2] = [None if t is None else gate_up_halves(t) for t in out[:2]]
    return out


class RoutedExperts(torch.autograd.Function):
    """apply(layout, x [S, H], top_k_index [S, k], top_k_weights [S, k], *stage params) -> out [S, H]

    The routing comes from outside: pairs p = t*k + j are sorted by expert (routing.dispatch_order,
    no capacity), run through expert_forward and combined with w = top_k_weights. Backward: stages
    1-4 (expert_backward), 5 (grad_input_combine), and stage 2's dots scattered back to [S, k] as
    dL/dtop_k_weights."""

    @staticmethod
    def forward(ctx, layout: ExpertsLayout, x, top_k_index, top_k_weights, *weights):
        num_tokens, k = top_k_index.shape
        num_experts = weights[0].shape[0]
        row_pair, counts, _ = dispatch_order(top_k_index, num_experts, None)
        params = dict(zip(layout.stage_names, weights))
        groups = ex.Groups.from_counts(counts)
        row_token = row_pair // k
        weight_rows = top_k_weights.reshape(-1)[row_pair]
        y, saved = ex.expert_forward(layout.expert, layout.activation, "identity", x[row_token], params, groups)
        out = comb.combine(y, weight_rows, row_pair, num_tokens, k).to(x.dtype)
        ctx.layout, ctx.counts, ctx.top_k = layout, counts, k
        ctx.weights_dtype = top_k_weights.dtype
        ctx.save_for_backward(x, row_pair, weight_rows, *weights, *saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        layout: ExpertsLayout = ctx.layout
        x, row_pair, weight_rows, *rest = ctx.saved_tensors
        weights, saved = rest[:4], tuple(rest[4:])
        params = dict(zip(layout.stage_names, weights))
        groups = ex.Groups.from_counts(ctx.counts)
        num_tokens, k = x.shape[0], ctx.top_k
        row_token = row_pair // k
        grad_xs, grad_dots, grads = ex.expert_backward(layout.expert, layout.activation, "identity",
                                                       grad_out.contiguous()[row_token], weight_rows, x[row_token],
                                                       saved, params, groups)
        grad_x = comb.grad_input_combine(grad_xs, row_pair, num_tokens, k).to(x.dtype)
        grad_weights = x.new_zeros(num_tokens * k, dtype=accumulation_dtype(x.dtype))
        grad_weights[row_pair] = grad_dots
        grad_params = [None if w is None else grads[n].to(w.dtype) for n, w in zip(layout.stage_names, weights)]
        return (None, grad_x, None, grad_weights.view(num_tokens, k).to(ctx.weights_dtype), *grad_params)


def experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The function registered as "shardmoe": hidden_states [S, H], top_k_index [S, k] int,
    top_k_weights [S, k] -> [S, H] in hidden_states' dtype."""
    layout = read_layout(experts)
    tensors = [None if n is None else getattr(experts, n) for n in layout.names]
    dtype = tensors[0].dtype
    if hidden_states.dtype != dtype:
        raise ValueError(f"hidden_states: expected dtype {dtype} (the experts' parameters), got {hidden_states.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0] \
            or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_index, top_k_weights: expected shapes [S, k] with S={hidden_states.shape[0]} "
                         f"(hidden_states' tokens), got {list(top_k_index.shape)}, {list(top_k_weights.shape)}")
    num_experts = tensors[0].shape[0]
    if top_k_index.numel() and (int(top_k_index.min()) < 0 or int(top_k_index.max()) >= num_experts):
        raise ValueError(f"top_k_index: expected expert ids in 0..{num_experts - 1}, got "
                         f"{int(top_k_index.min())}..{int(top_k_index.max())}")
    return RoutedExperts.apply(layout, hidden_states, top_k_index, top_k_weights,
                               *stage_parameters(layout, tensors))
