"""convert(model): every sparse MoE block of a transformers model computed by shardmoe.MoE.

  shardmoe.hf.convert(model)   in place; returns model

Each block (a module with an `experts` child decorated by use_experts_implementation) becomes a
ConvertedBlock holding from_block(block): routing and experts run in the MoE layer, forward and
backward. The model's own loss is kept, router aux loss included with the family's coefficient:
transformers computes that loss from the router logits it records with a hook on modules of the
family's router class (OutputRecorder), summed over all layers before the balance product
(load_balancing_loss_func), so it does not split into per-layer terms a layer could own. A
ConvertedBlock therefore keeps a RouterLogits child, an instance of a subclass of the family's
router class with no parameters, returning (x Wg,) with the layer's own gate weight: the hook
records it and the model's aux loss differentiates through it into the layer's gate_weight. The
layer's own aux_loss_coef stays 0, so nothing is counted twice. Costs one [S, H] x [H, E] GEMM
per block beyond the MoE layer.

Every block is read (from_block's refusals) before any is swapped.

Saving. A ConvertedBlock's state_dict holds the family's own entries (block_state_dict(layer):
'gate.weight', 'experts.gate_up_proj', ...), not the layer's, so save_pretrained writes a
checkpoint that plain transformers loads (it had written '...moe.gate_up_proj', which
from_pretrained reported missing and initialised at random). load_state_dict takes either: family
entries are read back through the original block's structure, kept on the meta device (no memory).
"""
from __future__ import annotations

import torch
from torch import nn

from shardmoe.hf.block_layer import block_state_dict, from_block, read_block
from shardmoe.moe.layer import MoE
from shardmoe.moe.routing import gate_logits
from shardmoe.moe.cpu import share as share_workspace


class RouterLogits(nn.Module):
    """router_logits = x Wg (+ b) [S, E] for x [..., H] (flattened to [S, H]), gate_weight [H, E] and
    the router bias [E] if the layer has one (GPT-OSS), returned as the first item of a tuple, as
    the family's router returns them."""

    def __init__(self):
        nn.Module.__init__(self)  # not the family router's __init__: no parameters of its own

    def forward(self, hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                gate_bias: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        # gate_logits: on CPU a narrow router's GEMM (and, under autograd, its weight gradient) in the
        # layouts MKL runs fast (docs/benchmarks.md, "The router's GEMMs in a narrow layout for E <= 8")
        logits = gate_logits(hidden_states.reshape(-1, gate_weight.shape[0]), gate_weight)
        return (logits if gate_bias is None else logits + gate_bias,)


def router_logits_module(router: nn.Module) -> RouterLogits:
    """A RouterLogits that is also an instance of the router's class (which the hook looks for)."""
    cls = type(f"RouterLogits{type(router).__name__}", (RouterLogits, type(router)), {})
    return cls()


class ConvertedBlock(nn.Module):
    """A sparse MoE block computed by `moe`: hidden_states [B, T, H] -> [B, T, H], as the block.
    `template` is the original block on the meta device (its structure, for loading the family's
    entries); it is not a submodule."""

    def __init__(self, moe: MoE, router_logits: RouterLogits, template: nn.Module, returns_pair: bool = False):
        super().__init__()
        self.moe = moe
        self.router_logits = router_logits
        self.returns_pair = returns_pair
        self.__dict__["template"] = template
        self._register_state_dict_hook(_family_entries)
        self._register_load_state_dict_pre_hook(_layer_entries, with_module=True)

    def forward(self, hidden_states: torch.Tensor):
        self.router_logits(hidden_states, self.moe.gate_weight, self.moe.gate_bias)
        out = self.moe(hidden_states)
        # GPT-OSS's block returns (hidden_states, router_scores) and its decoder layer discards the
        # scores: the pair keeps that call site working (the scores are not computed again here)
        return (out, None) if self.returns_pair else out


def _family_entries(module: "ConvertedBlock", state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict hook: the layer's entries replaced by the family's (block_state_dict)."""
    for key in [k for k in state_dict if k.startswith(prefix + "moe.")]:
        del state_dict[key]
    for key, value in block_state_dict(module.moe).items():
        state_dict[prefix + key] = value


def _layer_entries(module: "ConvertedBlock", state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: the family's entries under `prefix`, if any, read into the layer's
    through the original block's structure (from_block on the template, filled with them)."""
    family = [k for k in state_dict if k.startswith(prefix) and not k.startswith((prefix + "moe.",
                                                                                 prefix + "router_logits."))]
    if not family:
        return
    block = module.template.to_empty(device=module.moe.gate_weight.device)
    try:
        # assign: the entries themselves, in their dtype (a family may keep its router in float32,
        # and copying a float64 gate into that would round it)
        block.load_state_dict({k[len(prefix):]: state_dict.pop(k) for k in family}, assign=True)
        for key, value in from_block(block).state_dict().items():
            state_dict[prefix + "moe." + key] = value
    finally:
        block.to("meta")


def _is_sparse_block(module: nn.Module) -> bool:
    return hasattr(getattr(module, "experts", None), "has_gate")


def convert(model: nn.Module) -> nn.Module:
    """Swap every sparse MoE block of `model` for a ConvertedBlock, in place, and return the model.
    Raises ValueError, before swapping anything, for a block MoE cannot express, for a model
    without sparse blocks, and for a model that has already run a forward (its output hooks are
    installed and would miss the new router-logits modules)."""
    hooked = [n for n, m in model.named_modules() if getattr(m, "_output_capturing_hooks_installed", False)]
    if hooked:
        raise ValueError(f"model: expected a model that has not run a forward yet (transformers installs its "
                         f"output hooks at the first one and would not record the router logits of converted "
                         f"blocks), got hooks installed on {hooked[0] or 'the model'!r}")
    blocks = [(name, m) for name, m in model.named_modules() if _is_sparse_block(m)]
    if not blocks:
        raise ValueError(f"model: expected sparse MoE blocks (modules with a decorated `experts` child), found none "
                         f"in {type(model).__name__}")
    for _, block in blocks:
        read_block(block)
    layers = []
    for name, block in blocks:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        router = getattr(block, "gate", None) or getattr(block, "router")
        layers.append(from_block(block))  # copies the block's weights
        setattr(parent, child, ConvertedBlock(layers[-1], router_logits_module(router), block.to("meta"),
                                              returns_pair=type(block).__name__ == "GptOssMLP"))
    share_workspace(layers)  # one pool for all converted layers, as shardmoe.Transformer's
    return model
