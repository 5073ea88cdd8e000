"""A transformers sparse MoE block as a shardmoe.MoE layer, and back: the one way a block is imported.

  layer = shardmoe.hf.from_block(block, mesh=None, **overrides)
  block.load_state_dict(shardmoe.hf.block_state_dict(layer), strict=False)  the router and experts back

shardmoe.hf.convert(model) swaps every block of a model for such a layer, and
shardmoe.hf.mixtral.from_mixtral reads each block of a MixtralForCausalLM through read_block.

What each family's block computes, read from transformers 5.23 and mapped to MoE's options:
  Mixtral-like (Mixtral, Qwen3-MoE, OLMoE and the others of hf/blocks._MIXTRAL_LIKE):
      softmax, top-k, renormalised as the block does (norm_topk_prob): hf/blocks.py
  DeepSeek-V3 (DeepseekV3MoE):
      s = sigmoid(x W^T); selection on s + e_score_correction_bias among the topk_group of
      n_group groups (ranked by the sum of their two best corrected scores);
      w = routed_scaling_factor * s_sel / (sum s_sel + 1e-20) (norm_topk_prob) else scaled s_sel
      -> score_func="sigmoid", correction_bias=True, n_group, topk_group, renormalize_epsilon=1e-20,
         routed_scaling_factor; no aux loss (DeepSeek-V3's model computes none)
      shared_experts (DeepseekV3MLP: gate_proj, up_proj [Fs, H], down_proj [H, Fs], the experts'
      activation, no bias) -> shared_ffn_size=Fs, shared_gate_up_proj = [gate_proj; up_proj]
      [2Fs, H], shared_down_proj [H, Fs]; width 0 (n_shared_experts=0) adds nothing
  Qwen2-MoE (Qwen2MoeSparseMoeBlock):
      softmax, top-k, renormalised when norm_topk_prob (as Qwen3-MoE), plus shared_expert
      (Qwen2MoeMLP, the experts' activation) scaled per token by sigmoid(x . shared_expert_gate)
      -> shared_ffn_size, shared_gate=True, shared_gate_weight = shared_expert_gate.weight[0] [H]
  GPT-OSS (GptOssMLP):
      logits = x W^T + b, top-k of the logits, softmax over the k (= softmax then renormalise);
      experts gate_up_proj [E, H, 2F] with interleaved gate/up columns, its bias [E, 2F] likewise,
      down_proj [E, F, H], down_proj_bias [E, H], GPT-OSS's clamped SwiGLU (limit, alpha)
      -> router_bias=True (gate_bias = b), bias=True, activation="clamped_swiglu", swiglu_limit,
         swiglu_alpha; gate/up reordered to [gate | up] on import and interleaved back on export
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardmoe.hf.blocks import (experts_activation, gate_up_halves, gate_up_interleaved, mixtral_semantics, refuse,
                                unknown_activation)
from shardmoe.moe.composition import local
from shardmoe.moe.layer import MoE


@dataclass(frozen=True)
class BlockImport:
    """What MoE needs from a block: constructor options and the whole tensors, in MoE's layout
    (gate_weight [H, E], gate_up_proj [E, 2F, H], down_proj [E, H, F], correction_bias [E] or None)."""

    top_k: int
    options: dict
    gate_weight: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    correction_bias: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)  # other MoE parameter name (shared expert, biases) -> whole tensor


def _activation(block, module) -> str:
    name = experts_activation(module)
    if name is None:
        raise refuse(block, unknown_activation(module))
    return name


def _deepseek_v3(block) -> BlockImport:
    router, experts, shared = block.gate, block.experts, block.shared_experts
    expected = ("DeepseekV3TopkRouter", "DeepseekV3Experts")
    if (type(router).__name__, type(experts).__name__) != expected:
        raise refuse(block, f"expected router and experts {expected}, got "
                             f"{(type(router).__name__, type(experts).__name__)}")
    normalize = bool(router.norm_topk_prob)
    activation = _activation(block, experts)
    options = dict(expert="glu", activation=activation, score_func="sigmoid", correction_bias=True,
                   n_group=int(router.num_group), topk_group=int(router.topk_group), renormalize=normalize,
                   renormalize_epsilon=1e-20 if normalize else 0.0,
                   routed_scaling_factor=float(router.routed_scaling_factor))
    shared_params = {}
    if shared.gate_proj.out_features:
        options["shared_ffn_size"] = shared.gate_proj.out_features
        shared_params = _shared_mlp(block, shared, activation)
    return BlockImport(int(router.top_k), options, router.weight.t(), experts.gate_up_proj, experts.down_proj,
                       router.e_score_correction_bias, extra=shared_params)


def _shared_mlp(block, mlp, activation: str) -> dict[str, torch.Tensor]:
    """shared_gate_up_proj [2Fs, H] = [gate_proj; up_proj] and shared_down_proj [H, Fs] of a
    family's dense GLU MLP (gate_proj, up_proj, down_proj, act_fn), refused unless it computes
    act(x Wg^T) * (x Wu^T) Wd^T with the routed experts' activation and no biases."""
    shared = _activation(block, mlp)
    if shared != activation:
        raise refuse(block, f"shared experts with activation {shared!r}, the routed "
                             f"experts' is {activation!r} (MoE's shared expert uses the layer's)")
    if any(getattr(mlp, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
        raise refuse(block, "shared experts with biases")
    return {"shared_gate_up_proj": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            "shared_down_proj": mlp.down_proj.weight}


def _qwen2_moe(block) -> BlockImport:
    router, experts, shared, gate = block.gate, block.experts, block.shared_expert, block.shared_expert_gate
    expected = ("Qwen2MoeTopKRouter", "Qwen2MoeExperts", "Qwen2MoeMLP")
    got = (type(router).__name__, type(experts).__name__, type(shared).__name__)
    if got != expected:
        raise refuse(block, f"expected router, experts and shared expert {expected}, got {got}")
    if gate.bias is not None or gate.out_features != 1:
        raise refuse(block, f"shared_expert_gate: expected Linear(H, 1) without bias, got {gate}")
    activation = _activation(block, experts)
    options = dict(expert="glu", activation=activation, renormalize=bool(router.norm_topk_prob),
                   shared_ffn_size=shared.gate_proj.out_features, shared_gate=True)
    params = dict(_shared_mlp(block, shared, activation), shared_gate_weight=gate.weight[0])
    return BlockImport(int(router.top_k), options, router.weight.t(), experts.gate_up_proj, experts.down_proj,
                       extra=params)


def _gpt_oss(block) -> BlockImport:
    router, experts = block.router, block.experts
    expected = ("GptOssTopKRouter", "GptOssExperts")
    got = (type(router).__name__, type(experts).__name__)
    if got != expected:
        raise refuse(block, f"expected router and experts {expected}, got {got}")
    options = dict(expert="glu", activation="clamped_swiglu", swiglu_limit=float(experts.limit),
                   swiglu_alpha=float(experts.alpha), bias=True, router_bias=True, renormalize=True)
    extra = {"gate_bias": router.bias, "gate_up_proj_bias": gate_up_halves(experts.gate_up_proj_bias),
             "down_proj_bias": experts.down_proj_bias}
    return BlockImport(int(router.top_k), options, router.weight.t(),
                       gate_up_halves(experts.gate_up_proj.transpose(1, 2)), experts.down_proj.transpose(1, 2),
                       extra=extra)


def read_block(block) -> BlockImport:
    """The BlockImport of a supported block, or ValueError naming its family and the feature."""
    name = type(block).__name__
    if name == "DeepseekV3MoE":
        return _deepseek_v3(block)
    if name == "Qwen2MoeSparseMoeBlock":
        return _qwen2_moe(block)
    if name == "GptOssMLP":
        return _gpt_oss(block)
    semantics = mixtral_semantics(block)  # the whitelist; refuses shared experts, other routers, ...
    options = dict(expert="glu", activation=semantics.activation, renormalize=semantics.renormalize)
    return BlockImport(semantics.top_k, options, semantics.router_weight.t(), semantics.gate_up_proj,
                       semantics.down_proj)


def from_block(block, mesh=None, **overrides) -> MoE:
    """A shardmoe.MoE computing what the transformers sparse block `block` computes: the Mixtral-like
    families (hf/blocks.py), Qwen2-MoE (gated shared expert), DeepSeek-V3 (sigmoid, group-limited,
    corrected, scaled router; shared experts) and GPT-OSS (router bias, biased clamped-SwiGLU
    experts). The router weight [E, H] becomes gate_weight [H, E]; the experts are copied (this
    rank's shard of them with a sharded mesh); top_k, renormalize and the activation come from the
    block; `overrides` replace constructor options, even ones that contradict the block. A feature
    the layer cannot express raises ValueError naming the family and the feature, before anything
    is built or copied."""
    read = read_block(block)
    E, two_f, H = read.gate_up_proj.shape
    options = dict(read.options, dtype=read.gate_up_proj.dtype, device=read.gate_up_proj.device)
    options.update(overrides)
    layer = MoE(H, two_f // 2, E, read.top_k, mesh=mesh, **options)
    with torch.no_grad():
        local(layer.gate_weight).copy_(read.gate_weight)
        local(layer.gate_up_proj).copy_(layer.placement.shard("gate_up_proj", read.gate_up_proj))
        local(layer.down_proj).copy_(layer.placement.shard("down_proj", read.down_proj))
        if read.correction_bias is not None and layer.correction_bias is not None:
            layer.correction_bias.copy_(read.correction_bias)
        for name, whole in read.extra.items():  # the router bias is replicated, the rest sharded as experts
            local(getattr(layer, name)).copy_(whole if name == "gate_bias" else layer.placement.shard(name, whole))
    return layer


def block_state_dict(layer: MoE) -> dict[str, torch.Tensor]:
    """The router and experts entries of the equivalent block's state dict: 'gate.weight' [E, H],
    'experts.gate_up_proj' [E, 2F, H], 'experts.down_proj' [E, H, F], with a correction bias
    'gate.e_score_correction_bias' [E], with a shared expert 'shared_experts.{gate,up}_proj.weight'
    [Fs, H], 'shared_experts.down_proj.weight' [H, Fs] (DeepSeek-V3), or with a gated one the same
    under 'shared_expert.' and 'shared_expert_gate.weight' [1, H] (Qwen2-MoE). The block's own config must say what the
    layer's does (norm_topk_prob, n_group, ...): a state dict carries no options. With a sharded
    mesh the experts are gathered whole: collective over ('e', 't')."""
    c = layer.config
    if c.activation == "clamped_swiglu":
        return _gpt_oss_state_dict(layer)
    unsupported = [f"{name}={getattr(c, name)!r}" for name, ok in (
        ("expert", c.expert == "glu"), ("bias", not c.bias), ("router_bias", not c.router_bias),
        ("capacity_factor", c.capacity_factor is None),
        ("score_func", c.score_func == "softmax" or c.correction_bias)) if not ok]
    if unsupported:
        raise ValueError("block_state_dict: expected a dropless glu layer without expert or router biases, softmax "
                         f"or DeepSeek-V3's corrected sigmoid routing, or GPT-OSS's; got {', '.join(unsupported)}")
    _check_family_router(c)
    state = {"gate.weight": local(layer.gate_weight).detach().t().contiguous()}
    if layer.correction_bias is not None:
        state["gate.e_score_correction_bias"] = layer.correction_bias.detach().clone()
    for name in ("gate_up_proj", "down_proj"):
        state[f"experts.{name}"] = layer.placement.gather(name, local(getattr(layer, name)).detach()).clone()
    if c.shared_ffn_size:  # gated: Qwen2-MoE's shared_expert (+ shared_expert_gate); else DeepSeek-V3's
        prefix = "shared_expert." if c.shared_gate else "shared_experts."
        gate_up = layer.placement.gather("shared_gate_up_proj", local(layer.shared_gate_up_proj).detach())
        state[prefix + "gate_proj.weight"] = gate_up[:c.shared_ffn_size].clone()
        state[prefix + "up_proj.weight"] = gate_up[c.shared_ffn_size:].clone()
        state[prefix + "down_proj.weight"] = layer.placement.gather(
            "shared_down_proj", local(layer.shared_down_proj).detach()).clone()
        if c.shared_gate:
            state["shared_expert_gate.weight"] = local(layer.shared_gate_weight).detach()[None].clone()
    return state


def _check_family_router(c) -> None:
    """Raise ValueError unless a transformers block computes this router: a state dict carries no
    options, so an export whose router no family has would load into a block that routes otherwise.
    Softmax (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): no correction bias, groups, scaling or
    renormalisation epsilon; a shared expert only gated (Qwen2-MoE). Sigmoid with a correction bias
    (DeepSeek-V3): the renormalisation epsilon DeepSeek-V3 uses (1e-20, 0 without renormalising);
    a shared expert only ungated."""
    if c.score_func == "softmax":
        family = "softmax routing (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)"
        wanted = {"correction_bias": False, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                  "renormalize_epsilon": 0.0}
        if c.shared_ffn_size:
            wanted["shared_gate"] = True  # Qwen2-MoE's shared expert is gated; no softmax family has an ungated one
    else:
        family = "DeepSeek-V3's sigmoid routing"
        wanted = {"renormalize_epsilon": 1e-20 if c.renormalize else 0.0, "shared_gate": False}
    wrong = [f"{name}={getattr(c, name)!r} (expected {value!r})" for name, value in wanted.items()
             if getattr(c, name) != value]
    if wrong:
        raise ValueError(f"block_state_dict: no transformers block computes this router: with {family} expected "
                         f"the block's options, got {', '.join(wrong)}")


def _gpt_oss_state_dict(layer) -> dict[str, torch.Tensor]:
    """GptOssMLP's 'router.weight' [E, H], 'router.bias' [E], 'experts.gate_up_proj' [E, H, 2F] and
    its bias [E, 2F] (gate/up interleaved back), 'experts.down_proj' [E, F, H], its bias [E, H]."""
    c = layer.config
    unsupported = [f"{name}={getattr(c, name)!r}" for name, ok in (
        ("bias", c.bias), ("router_bias", c.router_bias), ("score_func", c.score_func == "softmax"),
        ("renormalize", c.renormalize), ("capacity_factor", c.capacity_factor is None),
        ("correction_bias", not c.correction_bias), ("shared_ffn_size", not c.shared_ffn_size),
        ("n_group", c.n_group == 1), ("routed_scaling_factor", c.routed_scaling_factor == 1),
        ("renormalize_epsilon", c.renormalize_epsilon == 0)) if not ok]
    if unsupported:
        raise ValueError("block_state_dict: a clamped-SwiGLU layer exports as GPT-OSS's block, which expects "
                         f"expert and router biases, softmax top-k renormalised, dropless; got {', '.join(unsupported)}")

    def whole(name):
        return layer.placement.gather(name, local(getattr(layer, name)).detach())

    return {"router.weight": local(layer.gate_weight).detach().t().contiguous(),
            "router.bias": local(layer.gate_bias).detach().clone(),
            "experts.gate_up_proj": gate_up_interleaved(whole("gate_up_proj")).transpose(1, 2).contiguous(),
            "experts.gate_up_proj_bias": gate_up_interleaved(whole("gate_up_proj_bias")).contiguous(),
            "experts.down_proj": whole("down_proj").transpose(1, 2).contiguous(),
            "experts.down_proj_bias": whole("down_proj_bias").clone()}
