"""Whole-block import and export between transformers sparse MoE blocks and shardmoe.MoE.

  layer = MoE.from_hf(block, mesh=None, **overrides)      (delegates to from_hf below)
  block.load_state_dict(layer.to_hf_state_dict(), strict=False)  the router and experts back

What each family's block computes, read from transformers 5.23 and mapped to MoE's options:
  Mixtral-like (Mixtral, Qwen3-MoE, OLMoE and the others of moe/hf_blocks._MIXTRAL_LIKE):
      softmax, top-k, renormalised as the block does (norm_topk_prob): moe/hf_blocks.py
  DeepSeek-V3 (DeepseekV3MoE):
      s = sigmoid(x W^T); selection on s + e_score_correction_bias among the topk_group of
      n_group groups (ranked by the sum of their two best corrected scores);
      w = routed_scaling_factor * s_sel / (sum s_sel + 1e-20) (norm_topk_prob) else scaled s_sel
      -> score_func="sigmoid", correction_bias=True, n_group, topk_group, renormalize_epsilon=1e-20,
         routed_scaling_factor; no aux loss (DeepSeek-V3's model computes none)
      shared_experts (DeepseekV3MLP: gate_proj, up_proj [Fs, H], down_proj [H, Fs], the experts'
      activation, no bias) -> shared_ffn_size=Fs, shared_gate_up_proj = [gate_proj; up_proj]
      [2Fs, H], shared_down_proj [H, Fs]; width 0 (n_shared_experts=0) adds nothing
Refused, with the family and the feature: Qwen2-MoE's gated shared expert (its block is not read
yet; the layer has the option, shared_gate) and GPT-OSS's clamped SwiGLU (the layer has it; the
interleaved gate/up import is not written yet).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardmoe.hf.experts import experts_activation
from shardmoe.moe.hf_blocks import family_name, mixtral_semantics
from shardmoe.parallel import expert_tensor as etp


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
    shared: dict = field(default_factory=dict)  # shared-expert parameter name -> whole tensor


def _refuse(block, feature: str) -> ValueError:
    return ValueError(f"block: MoE.from_hf cannot express family {family_name(block)!r} "
                      f"({type(block).__name__}): {feature}")


def _deepseek_v3(block) -> BlockImport:
    router, experts, shared = block.gate, block.experts, block.shared_experts
    expected = ("DeepseekV3TopkRouter", "DeepseekV3Experts")
    if (type(router).__name__, type(experts).__name__) != expected:
        raise _refuse(block, f"expected router and experts {expected}, got "
                             f"{(type(router).__name__, type(experts).__name__)}")
    normalize = bool(router.norm_topk_prob)
    activation = experts_activation(experts)
    options = dict(expert="glu", activation=activation, score_func="sigmoid", correction_bias=True,
                   n_group=int(router.num_group), topk_group=int(router.topk_group), renormalize=normalize,
                   renormalize_epsilon=1e-20 if normalize else 0.0,
                   routed_scaling_factor=float(router.routed_scaling_factor))
    shared_params = {}
    shared_width = shared.gate_proj.out_features
    if shared_width:
        if experts_activation(shared) != activation:
            raise _refuse(block, f"shared experts with activation {experts_activation(shared)!r}, the routed "
                                 f"experts' is {activation!r} (MoE's shared expert uses the layer's)")
        if any(getattr(shared, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
            raise _refuse(block, "shared experts with biases")
        options["shared_ffn_size"] = shared_width
        shared_params = {"shared_gate_up_proj": torch.cat([shared.gate_proj.weight, shared.up_proj.weight]),
                         "shared_down_proj": shared.down_proj.weight}
    return BlockImport(int(router.top_k), options, router.weight.t(), experts.gate_up_proj, experts.down_proj,
                       router.e_score_correction_bias, shared_params)


def read_block(block) -> BlockImport:
    """The BlockImport of a supported block, or ValueError naming its family and the feature."""
    name = type(block).__name__
    if name == "DeepseekV3MoE":
        return _deepseek_v3(block)
    if name == "GptOssMLP":
        raise _refuse(block, "the experts' clamped SwiGLU (GptOssExperts._apply_gate, swiglu_limit="
                             f"{block.experts.limit}, swiglu_alpha={block.experts.alpha}) is not an activation of MoE")
    semantics = mixtral_semantics(block)  # the whitelist; refuses shared experts, other routers, ...
    options = dict(expert="glu", activation=semantics.activation, renormalize=semantics.renormalize)
    return BlockImport(semantics.top_k, options, semantics.router_weight.t(), semantics.gate_up_proj,
                       semantics.down_proj)


def from_hf(cls, block, mesh=None, **overrides):
    """MoE of class `cls` computing what `block` computes (this rank's expert shard with a mesh);
    `overrides` replace constructor options. Refusals happen before anything is built."""
    read = read_block(block)
    E, two_f, H = read.gate_up_proj.shape
    options = dict(read.options, dtype=read.gate_up_proj.dtype, device=read.gate_up_proj.device)
    options.update(overrides)
    layer = cls(H, two_f // 2, E, read.top_k, mesh=mesh, **options)
    with torch.no_grad():
        layer.gate_weight.copy_(read.gate_weight)
        layer.gate_up_proj.copy_(etp.shard_expert_param("gate_up_proj", read.gate_up_proj, mesh))
        layer.down_proj.copy_(etp.shard_expert_param("down_proj", read.down_proj, mesh))
        if read.correction_bias is not None and layer.correction_bias is not None:
            layer.correction_bias.copy_(read.correction_bias)
        for name, whole in read.shared.items():
            getattr(layer, name).copy_(etp.shard_expert_param(name, whole, mesh))
    return layer


def to_hf_state_dict(layer) -> dict[str, torch.Tensor]:
    """The router and experts entries of the equivalent block's state dict: 'gate.weight' [E, H],
    'experts.gate_up_proj' [E, 2F, H], 'experts.down_proj' [E, H, F], with a correction bias
    'gate.e_score_correction_bias' [E] and with a shared expert 'shared_experts.{gate,up}_proj.weight'
    [Fs, H], 'shared_experts.down_proj.weight' [H, Fs] (DeepSeek-V3). The block's own config must say what the
    layer's does (norm_topk_prob, n_group, ...): a state dict carries no options. With a sharded
    mesh the experts are gathered whole: collective over ('e', 't')."""
    c = layer.config
    unsupported = [f"{name}={getattr(c, name)!r}" for name, ok in (
        ("expert", c.expert == "glu"), ("bias", not c.bias), ("router_bias", not c.router_bias),
        ("capacity_factor", c.capacity_factor is None), ("shared_gate", not c.shared_gate),
        ("score_func", c.score_func == "softmax" or c.correction_bias)) if not ok]
    if unsupported:
        raise ValueError("to_hf_state_dict: expected a dropless glu layer without expert or router biases or a "
                         "gated shared expert, softmax or DeepSeek-V3's corrected sigmoid routing; got "
                         f"{', '.join(unsupported)}")
    state = {"gate.weight": layer.gate_weight.detach().t().contiguous()}
    if layer.correction_bias is not None:
        state["gate.e_score_correction_bias"] = layer.correction_bias.detach().clone()
    for name in ("gate_up_proj", "down_proj"):
        state[f"experts.{name}"] = etp.gather_expert_param(name, getattr(layer, name).detach(), layer.mesh).clone()
    if c.shared_ffn_size:
        gate_up = etp.gather_expert_param("shared_gate_up_proj", layer.shared_gate_up_proj.detach(), layer.mesh)
        state["shared_experts.gate_proj.weight"] = gate_up[:c.shared_ffn_size].clone()
        state["shared_experts.up_proj.weight"] = gate_up[c.shared_ffn_size:].clone()
        state["shared_experts.down_proj.weight"] = etp.gather_expert_param(
            "shared_down_proj", layer.shared_down_proj.detach(), layer.mesh).clone()
    return state
