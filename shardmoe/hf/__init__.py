"""transformers interop, all of it: importing shardmoe.hf registers the "shardmoe" experts implementation.

  import shardmoe.hf
  model = AutoModelForCausalLM.from_config(cfg, experts_implementation="shardmoe")

runs every experts module decorated with transformers' use_experts_implementation through
shardmoe's expert stages (hf/seam.py); the family's router, shared experts and the rest of the
model stay the family's own. The other ways in:

  shardmoe.hf.from_block(block)        one sparse block as a shardmoe.MoE (hf/block_layer.py; what a
                                       block computes is read by hf/blocks.py), and
  shardmoe.hf.block_state_dict(layer)  the block's router and experts entries back
  shardmoe.hf.convert(model)           every sparse block of a model swapped for such a layer
                                       (hf/converted.py)
  shardmoe.hf.mixtral.from_mixtral     a MixtralForCausalLM as shardmoe's Transformer, and
                                       export_mixtral back (hf/mixtral.py)

docs/hf.md lists the families and their status.
transformers is imported here, so nothing else in shardmoe imports this package at import time.
transformers is an optional dependency (the "hf" extra): without it, importing this package raises
a ModuleNotFoundError that says how to install it.
"""
from __future__ import annotations

try:
    import transformers  # noqa: F401
except ModuleNotFoundError as error:
    if error.name != "transformers":  # transformers is there but one of its own imports failed
        raise
    raise ModuleNotFoundError("shardmoe.hf needs transformers>=5,<6, which is not installed: "
                              "pip install 'shardmoe[hf]'", name="transformers") from None

from transformers.integrations.moe import ExpertsInterface

from shardmoe.hf.block_layer import block_state_dict, from_block
from shardmoe.hf.converted import convert
from shardmoe.hf.seam import experts_forward, read_layout

IMPLEMENTATION = "shardmoe"

ExpertsInterface.register(IMPLEMENTATION, experts_forward)

__all__ = ["IMPLEMENTATION", "block_state_dict", "convert", "experts_forward", "from_block", "read_layout"]
