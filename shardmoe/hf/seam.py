"""The "shardmoe" experts implementation behind transformers' experts seam.

transformers 5.x experts classes decorated with `use_experts_implementation` send their forward
to ALL_EXPERTS_FUNCTIONS[config._experts_implementation] as

  f(experts, hidden_states [S, H], top_k_index [S, k], top_k_weights [S, k]) -> [S, H]
  out_t = sum_j w_tj y_{e_tj}(x_t),   w = top_k_weights, e = top_k_index

with the family's own router upstream. `experts_forward` runs that through the layer's own
MoE operators (moe/function.py) with the routing given (routing.GivenRouting) and the
local dispatcher: the same device choice, workspace pool, one-pass glu backward and Triton path as
shardmoe.MoE. Backward is the explicit one: stages 1-5, and stage 2's dots
dw_tj = g_t . y_{e_tj}(x_t) are exactly dL/dtop_k_weights, through which the family's router gets
its gradient (stage 6 is the family's own, by autograd).

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

import weakref
from dataclasses import dataclass

import torch

from shardmoe.expert_kinds import expert_kind
from shardmoe.moe.activations import ClampedSwiGLU
from shardmoe.moe.config import MoEConfig
from shardmoe.moe import function, precision
from shardmoe.moe.dispatch import LOCAL
from shardmoe.moe.function import MoEContext
from shardmoe.hf.blocks import experts_activation, family_name, gate_up_halves, unknown_activation
from shardmoe.moe.routing import GivenRouting
from shardmoe.moe.cpu import Workspace


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
        return expert_kind(self.expert).param_names(bias=True)


def _refuse(experts, feature: str) -> ValueError:
    return ValueError(f"experts: the 'shardmoe' experts implementation cannot run family {family_name(experts)!r} "
                      f"({type(experts).__name__}): {feature}")


def _activation(experts) -> str:
    name = experts_activation(experts)
    if name is None:
        raise _refuse(experts, unknown_activation(experts))
    return name


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
                               "shardmoe shards experts itself (shardmoe.hf.from_block with a mesh)")
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
    return ExpertsLayout(family_name(experts), expert, activation or _activation(experts), names,
                         bool(experts.is_transposed), interleaved)


def stage_parameters(layout: ExpertsLayout, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The module's tensors (in layout.names order) as the stage parameters [E, O, K], by
    differentiable views (the stages take any strides); interleaved gate/up rows are reordered."""
    out = [t.transpose(-2, -1) if layout.transposed and t is not None and t.dim() == 3 else t for t in tensors]
    if layout.interleaved:  # gate_up_proj and its bias are the first two
        out[:2] = [None if t is None else gate_up_halves(t) for t in out[:2]]
    return out


def layer_config(layout: ExpertsLayout, hidden_size: int, ffn_size: int, num_experts: int, top_k: int) -> MoEConfig:
    """The MoEConfig of an experts module's computation: its expert kind, activation and biases; the
    routing is given, so the router options are MoEConfig's defaults (none of them is read)."""
    activation = layout.activation
    if isinstance(activation, ClampedSwiGLU):
        options = dict(activation="clamped_swiglu", swiglu_limit=activation.limit, swiglu_alpha=activation.alpha)
    else:
        options = dict(activation=activation)
    return MoEConfig(hidden_size, ffn_size, num_experts, top_k, expert=layout.expert,
                     bias=layout.names[1] is not None, renormalize=False, **options)


class SeamOwner:
    """What the MoE operators (moe/function.py) run one experts module's forward and backward with: the
    layout read once, the given routing, the local dispatcher and the model's workspace pool."""

    def __init__(self, experts, layout: ExpertsLayout):
        self.layout = layout
        self.workspace = _model_workspace(experts)
        self.handle = function.register(self)

    def __reduce__(self):
        """A copy of the module (copy.deepcopy, pickle) gets no owner: it makes its own, with its own
        handle, at its first forward (the original's handle dies with the original)."""
        return _no_owner, ()

    def moe_context(self, x: torch.Tensor, inputs: tuple) -> MoEContext:
        top_k_index, top_k_weights, *weights = inputs
        stage = dict(zip(operator_param_names(self.layout), weights))
        num_experts, ffn = stage[self.layout.stage_names[2]].shape[0], stage[self.layout.stage_names[2]].shape[-1]
        config = layer_config(self.layout, x.shape[-1], ffn, num_experts, top_k_index.shape[1])
        return MoEContext(config, GivenRouting(num_experts), LOCAL, self.workspace)


def operator_param_names(layout: ExpertsLayout) -> tuple[str, ...]:
    """The expert params the MoE operators take for this layout, in their order."""
    return expert_kind(layout.expert).param_names(layout.names[1] is not None)


def _model_workspace(experts) -> Workspace:
    """The pool of row buffers an experts module's forwards draw from: one per model config object
    (every decoder layer of a model shares it, as the shardmoe.MoE layers of one model do), made on
    first use and released with the config."""
    config = getattr(experts, "config", None)
    if config is None:  # an experts module built without a config: a pool of its own
        return Workspace()
    pool = _POOLS.get(id(config))
    if pool is None or pool[0]() is not config:
        pool = (weakref.ref(config, lambda _, key=id(config): _POOLS.pop(key, None)), Workspace())
        _POOLS[id(config)] = pool
    return pool[1]


# id(model config) -> (weak reference to it, its pool); configs define __eq__, so they are not keys
_POOLS: dict[int, tuple[weakref.ref, Workspace]] = {}


def _no_owner() -> None:
    return None


def seam_handle(experts) -> int:
    """The MoE operators' handle of this experts module, made on its first forward (a constant of
    the module, so a compiled graph carries it as one)."""
    owner = experts.__dict__.get("_shardmoe_owner")
    return _new_seam_handle(experts) if owner is None else owner.handle


@torch.compiler.assume_constant_result
def _new_seam_handle(experts) -> int:
    """Makes the owner at the module's first forward; later forwards, traced or not, read it in
    seam_handle. Marked constant so that a first forward traced by torch.compile makes it while
    tracing (torch >= 2.13; torch 2.11 cannot pass a module to such a function, so there the first
    forward must run eagerly, as a transformers model's must anyway: its hooks are not traceable)."""
    owner = SeamOwner(experts, read_layout(experts))
    experts.__dict__["_shardmoe_owner"] = owner
    return owner.handle


def experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The function registered as "shardmoe": hidden_states [S, H], top_k_index [S, k] int,
    top_k_weights [S, k] -> [S, H] in hidden_states' dtype. The expert ids are checked against E
    inside the operator (routing.GivenRouting), before any work: reading them here would put a
    data-dependent Python int in a compiled graph."""
    handle = seam_handle(experts)
    layout = experts._shardmoe_owner.layout
    tensors = [None if n is None else getattr(experts, n) for n in layout.names]
    dtype = tensors[0].dtype
    # under torch.autocast the experts compute in its dtype, the parameters' gradients land in theirs
    autocast = precision.autocast_dtype(hidden_states, dtype)
    if autocast is None and hidden_states.dtype != dtype:
        raise ValueError(f"hidden_states: expected dtype {dtype} (the experts' parameters), got {hidden_states.dtype}")
    hidden_states, *tensors = precision.cast((hidden_states, *tensors), autocast)
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0] \
            or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_index, top_k_weights: expected shapes [S, k] with S={hidden_states.shape[0]} "
                         f"(hidden_states' tokens), got {list(top_k_index.shape)}, {list(top_k_weights.shape)}")
    stage = dict(zip(layout.stage_names, stage_parameters(layout, tensors)))
    present, absent = function.operator_inputs((top_k_index, top_k_weights,
                                                *(stage[n] for n in operator_param_names(layout))))
    out, _, _ = torch.ops.shardmoe.moe_forward(handle, hidden_states, present, absent)
    return out
