"""from_torchtitan(moe) and swap_moe(model): built torchtitan MoE modules become shardmoe.torchtitan.MoE.

  fused = shardmoe.torchtitan.from_torchtitan(moe)   a torchtitan MoE -> the shardmoe-backed one
  shardmoe.torchtitan.swap_moe(model)                every torchtitan MoE in the model, in place

The converted module holds the torchtitan module's own children (router, routed_experts,
shared_experts), parameters and buffers, not copies, with their init and sharding configs, so a
model swapped on the meta device is initialised, parallelized and checkpointed by torchtitan as
before. Swap before torchtitan's parallelize function: it wraps a module's forward and distributes
its parameters, which a converted module would not carry over (refused).
"""
from __future__ import annotations

from torch import nn
from torchtitan.models.common import moe as titan_moe

from shardmoe.torchtitan.moe import MoE


def from_torchtitan(moe: titan_moe.MoE) -> MoE:
    """The shardmoe.torchtitan.MoE computing what the built torchtitan MoE `moe` computes, holding
    its children, parameters and buffers (no copy; `moe` itself is left as it was). One already
    converted is returned as it is. ValueError, before anything changes, for anything else, for a
    module torchtitan's parallelize has wrapped or that carries hooks, and for what the MoE layer
    cannot compute (moe.moe_config's refusals)."""
    if isinstance(moe, MoE):
        return moe
    if type(moe) is not titan_moe.MoE:
        raise ValueError(f"moe: expected torchtitan's MoE (torchtitan.models.common.moe.MoE), got {type(moe).__name__}")
    if moe._parallelized:
        raise ValueError("moe: expected a torchtitan MoE not yet parallelized (swap before the model's parallelize "
                         "function, which wraps its forward), got one parallelized")
    hooks = [name for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
                               "_load_state_dict_pre_hooks") if getattr(moe, name)]
    if hooks:
        raise ValueError(f"moe: expected a torchtitan MoE without hooks (the converted module would not carry them "
                         f"over), got {', '.join(hooks)}")
    fused = MoE.__new__(MoE)
    nn.Module.__init__(fused)
    own = set(vars(fused))
    # torchtitan MoE's plain attributes (load_balance_coeff, a None expert_bias_E, the param_init and
    # sharding_config build set on the instance), then its children, parameters and buffers
    fused.__dict__.update({name: value for name, value in vars(moe).items() if name not in own})
    fused._modules.update(moe._modules)
    fused._parameters.update(moe._parameters)
    for name, buffer in moe._buffers.items():
        fused.register_buffer(name, buffer, persistent=name not in moe._non_persistent_buffers_set)
    fused.train(moe.training)
    fused._attach()
    return fused


def swap_moe(model: nn.Module) -> nn.Module:
    """Every torchtitan MoE of `model` (DeepSeek-V3's, Qwen3-MoE's, ... blocks' `moe`, the MTP
    layers' too) replaced by from_torchtitan of it, in place; returns model. All are converted
    before any is swapped, so a refusal leaves the model as it was; ValueError when the model holds
    none."""
    found = [(parent, name, child, f"{prefix}.{name}" if prefix else name)
             for prefix, parent in model.named_modules() for name, child in parent.named_children()
             if isinstance(child, titan_moe.MoE)]
    if not found:
        raise ValueError(f"model: expected a torchtitan model holding torchtitan MoE modules, got "
                         f"{type(model).__name__} with none")
    fused = []
    for _, _, child, fqn in found:
        try:
            fused.append(from_torchtitan(child))
        except ValueError as error:
            raise ValueError(f"{fqn}.{error}") from None
    for (parent, name, _, _), module in zip(found, fused):
        setattr(parent, name, module)
    return model
