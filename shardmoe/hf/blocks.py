"""What a transformers sparse MoE block computes, read before anything is copied from it.

MoE expresses one routing rule (docs/moe.md "Forward"): for tokens x [S, H] and a router weight
W [E, H],

  p = softmax(x W^T)                              [S, E]   no router bias, no correction bias
  (w, idx) = top-k of p                           [S, k]
  w <- w / sum(w)        only when renormalising
  y = sum_j w_j * down_proj[idx_j] (act(g) * u),  (g, u) = gate_up_proj[idx_j] x split in halves

with gate_up_proj [E, 2F, H], down_proj [E, H, F] and no expert biases. transformers has dozens of
sparse blocks that look alike (a `gate` or `router`, an `experts` module with the same tensors) but
add shared experts, sigmoid or group-limited routers, correction biases, scaling factors or
jitter; copying their weights into MoE gives outputs that are simply wrong. So the check is
positive: a block is accepted only when its class is one whose forward was read and found to be
the rule above (_MIXTRAL_LIKE, transformers 5.23), and its instance carries none of the features
that rule cannot express. Anything else raises ValueError naming the family and the feature,
so a family added to transformers later is refused until someone reads it and adds it here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# shardmoe activation name <-> transformers ACT2FN name
MIXTRAL_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}

# Block class -> (router attribute, router class, experts class, renormalisation). Renormalisation
# is True or False when the router always or never divides by the top-k sum, or "norm_topk_prob"
# when the router reads that flag. GraniteMoe's router takes the softmax over the top-k logits,
# which equals the renormalised top-k of the softmax over all logits.
_MIXTRAL_LIKE: dict[str, tuple[str, str, str, bool | str]] = {
    "MixtralSparseMoeBlock": ("gate", "MixtralTopKRouter", "MixtralExperts", True),
    "MiniMaxSparseMoeBlock": ("gate", "MiniMaxTopKRouter", "MiniMaxExperts", True),
    "Qwen3VLMoeTextSparseMoeBlock": ("gate", "Qwen3VLMoeTextTopKRouter", "Qwen3VLMoeTextExperts", True),
    "GraniteMoeMoE": ("router", "GraniteMoeTopKRouter", "GraniteMoeExperts", True),
    "GraniteMoeSWAMoE": ("router", "GraniteMoeSWATopKRouter", "GraniteMoeSWAExperts", True),
    "GraniteMoeHybridMoE": ("router", "GraniteMoeHybridTopKRouter", "GraniteMoeHybridExperts", True),
    "GraniteMoeSharedMoE": ("router", "GraniteMoeSharedTopKRouter", "GraniteMoeSharedExperts", True),
    "JambaSparseMoeBlock": ("router", "JambaTopKRouter", "JambaExperts", False),
    "Qwen3MoeSparseMoeBlock": ("gate", "Qwen3MoeTopKRouter", "Qwen3MoeExperts", "norm_topk_prob"),
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": ("gate", "Qwen3OmniMoeThinkerTextTopKRouter",
                                              "Qwen3OmniMoeThinkerTextExperts", "norm_topk_prob"),
    "OlmoeSparseMoeBlock": ("gate", "OlmoeTopKRouter", "OlmoeExperts", "norm_topk_prob"),
    "FlexOlmoSparseMoeBlock": ("gate", "FlexOlmoTopKRouter", "FlexOlmoExperts", "norm_topk_prob"),
    "MellumSparseMoeBlock": ("gate", "MellumTopKRouter", "MellumExperts", "norm_topk_prob"),
}

_JITTER_NAMES = ("jitter_noise", "router_jitter_noise", "input_jitter_noise")
_SCALING_NAMES = ("routed_scaling_factor", "scaling_factor", "router_scaling_factor")


@dataclass(frozen=True)
class MixtralSemantics:
    """The MoE options and tensors of an accepted block: router_weight [E, H], gate_up_proj
    [E, 2F, H], down_proj [E, H, F] (the block's own tensors, not copies)."""

    top_k: int
    renormalize: bool
    activation: str
    router_weight: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor


def family_name(block) -> str:
    """'qwen3_moe' for transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock."""
    parts = type(block).__module__.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-3:-2] == ["models"] else type(block).__module__


def refuse(block, feature: str) -> ValueError:
    """The ValueError of a block the MoE layer cannot express: its family, class and the feature."""
    return ValueError(f"block: shardmoe.MoE cannot express family {family_name(block)!r} "
                      f"({type(block).__name__}): {feature}")


def _names(module) -> list[str]:
    if not isinstance(module, torch.nn.Module):
        return []
    return ([n for n, _ in module.named_modules()] + [n for n, _ in module.named_parameters()]
            + [n for n, _ in module.named_buffers()])


def _router(block):
    for attr in ("gate", "router"):
        if isinstance(getattr(block, attr, None), torch.nn.Module):
            return getattr(block, attr)
    return None


def _unsupported_features(block) -> list[str]:
    """Every feature of the block MoE cannot express, detected by what the instance holds."""
    names = _names(block)
    router, experts = _router(block), getattr(block, "experts", None)
    features = []
    shared = sorted({n.split(".")[0] for n in names if "shared" in n.split(".")[0]})
    if shared:
        features.append(f"shared experts are not supported (found {', '.join(shared)})")
    correction = [n for n in names if "correction_bias" in n or n.split(".")[-1] == "expert_bias"]
    if correction:
        features.append(f"a correction bias on the expert scores is not supported (found {correction[0]})")
    if router is None:
        features.append("router kind: expected a `gate` or `router` module, found neither")
    router_bias = [n for n in _names(router) if n.split(".")[-1] == "bias"]
    if router_bias:
        features.append(f"a router bias is not supported (found {router_bias[0]})")
    for owner in (block, router):
        for name in _SCALING_NAMES:
            value = getattr(owner, name, None)
            if isinstance(value, (int, float)) and value != 1:
                features.append(f"a scaling factor is not supported ({name}={value})")
        for name in _JITTER_NAMES:
            value = getattr(owner, name, None)
            if isinstance(value, (int, float)) and value > 0:
                features.append(f"router jitter is not supported ({name}={value}; MoE trains without noise, "
                                "so the block's training forward would differ)")
    if not isinstance(experts, torch.nn.Module):
        features.append("expert layout: expected an `experts` module holding gate_up_proj and down_proj")
    else:
        expert_tensors = sorted(n for n, _ in experts.named_parameters())
        if expert_tensors != ["down_proj", "gate_up_proj"]:
            features.append("expert layout: expected exactly the parameters gate_up_proj [E, 2F, H] and "
                            f"down_proj [E, H, F], got {expert_tensors}")
    return features


def mixtral_semantics(block) -> MixtralSemantics:
    """Read what the block computes, or raise ValueError naming its family and the feature MoE
    cannot express. Reads only; nothing is copied."""
    features = _unsupported_features(block)
    known = _MIXTRAL_LIKE.get(type(block).__name__)
    router, experts = _router(block), getattr(block, "experts", None)
    if router is not None and (known is None or getattr(block, known[0], None) is not router):
        features.append(f"router kind: {type(block).__name__} with router {type(router).__name__} is not a block "
                        "known to route by softmax(x W^T), top-k (the known ones are listed in "
                        "shardmoe/hf/blocks.py)")
    if features:
        raise refuse(block, "; ".join(features))
    _, router_cls, experts_cls, renormalize = known
    if type(router).__name__ != router_cls:
        raise refuse(block, f"router kind: expected router {router_cls}, got {type(router).__name__}")
    if type(experts).__name__ != experts_cls:
        raise refuse(block, f"expert layout: expected experts {experts_cls}, got {type(experts).__name__}")
    if renormalize == "norm_topk_prob":
        renormalize = bool(router.norm_topk_prob)
    gate_up, down, weight = experts.gate_up_proj, experts.down_proj, router.weight
    E, H = weight.shape if weight.dim() == 2 else (-1, -1)
    F = gate_up.shape[1] // 2 if gate_up.dim() == 3 else -1
    if E < 1 or tuple(gate_up.shape) != (E, 2 * F, H) or tuple(down.shape) != (E, H, F):
        raise refuse(block, f"expert layout: expected router weight [E, H], gate_up_proj [E, 2F, H], down_proj "
                             f"[E, H, F], got {list(weight.shape)}, {list(gate_up.shape)}, {list(down.shape)}")
    return MixtralSemantics(top_k=int(router.top_k), renormalize=renormalize, activation=_activation(block),
                            router_weight=weight, gate_up_proj=gate_up, down_proj=down)


def _activation(block) -> str:
    """The shardmoe name of the experts' activation, checked against the module it really calls."""
    from transformers.activations import ACT2FN  # the block is a transformers module: it is imported

    experts = block.experts
    act = getattr(getattr(experts, "config", None), "hidden_act", None)
    by_hf_name = {v: k for k, v in MIXTRAL_ACTIVATIONS.items()}
    if act not in by_hf_name or type(getattr(experts, "act_fn", None)) is not type(ACT2FN[act]):
        raise refuse(block, f"activation: expected hidden_act in {sorted(by_hf_name)} (act_fn of that kind), "
                             f"got {act!r} ({type(getattr(experts, 'act_fn', None)).__name__})")
    return by_hf_name[act]


# -- layouts shared by from_block (hf/block_layer.py) and the experts seam (hf/seam.py) ----------


def _act_fn_names() -> dict:
    from transformers.activations import ACT2FN  # called on transformers modules: it is imported

    return {type(ACT2FN[hf]): name for name, hf in [*MIXTRAL_ACTIVATIONS.items(), ("silu", "swish")]}


def unknown_activation(module) -> str:
    """The refusal's feature text for a module whose act_fn experts_activation does not know."""
    known = sorted(c.__name__ for c in _act_fn_names())
    return f"activation: expected act_fn one of {known}, got {type(getattr(module, 'act_fn', None)).__name__}"


def experts_activation(module) -> str | None:
    """shardmoe's name for module.act_fn (an experts module or an MLP), read off its class (the config
    field that names it differs by family: hidden_act, mlp_hidden_act, ...); None when it is none
    of MIXTRAL_ACTIVATIONS' (the caller refuses, naming what it was reading)."""
    return _act_fn_names().get(type(getattr(module, "act_fn", None)))


def gate_up_halves(t: torch.Tensor) -> torch.Tensor:
    """Interleaved rows [g0, u0, g1, u1, ...] of gate_up [E, 2F, ...] -> [gate | up] (an autograd copy)."""
    E, two_f, *rest = t.shape
    return t.unflatten(1, (two_f // 2, 2)).transpose(1, 2).reshape(E, two_f, *rest)


def gate_up_interleaved(t: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows of [E, 2F, ...] -> interleaved [g0, u0, g1, u1, ...] (inverse of gate_up_halves)."""
    E, two_f, *rest = t.shape
    return t.unflatten(1, (2, two_f // 2)).transpose(1, 2).reshape(E, two_f, *rest)
