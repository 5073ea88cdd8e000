"""torchtitan interop: torchtitan's MoE run by shardmoe's MoE layer, swapped into a model in three lines.

  import shardmoe.torchtitan
  model = model_config.build()             # a torchtitan model with MoE blocks (DeepSeek-V3, Qwen3-MoE, ...)
  shardmoe.torchtitan.swap_moe(model)      # every torchtitan MoE -> shardmoe.torchtitan.MoE

or, before the model is built (torchtitan's trainer builds it itself), one setting of the config:
  --override.imports shardmoe.torchtitan.fused_moe

shardmoe.torchtitan.MoE (shardmoe/torchtitan/moe.py) is torchtitan's MoE with its own router,
routed experts, shared experts, buffers, init and sharding configs, whose forward is shardmoe's
MoE operator: the state dict, checkpoints, the HF state-dict adapters, the load-balancing
hook and torchtitan's parallelize functions see torchtitan's module. from_torchtitan(moe) converts
one built MoE (shardmoe/torchtitan/swap.py). docs/torchtitan.md has the mapping, the exactness and
the speed. torchtitan is an optional dependency (the "torchtitan" extra): without it, importing this
package raises a ModuleNotFoundError that says how to install it; nothing else in shardmoe imports it.
"""
from __future__ import annotations

try:
    import torchtitan  # noqa: F401
except ModuleNotFoundError as error:
    if error.name != "torchtitan":  # torchtitan is there but one of its own imports failed
        raise
    raise ModuleNotFoundError("shardmoe.torchtitan needs torchtitan>=0.3.0,<0.4, which is not installed: "
                              "pip install 'shardmoe[torchtitan]'", name="torchtitan") from None

from torchtitan.config import derive, override
from torchtitan.models.common import moe as titan_moe

from shardmoe.torchtitan.moe import MoE
from shardmoe.torchtitan.swap import from_torchtitan, swap_moe


@override(target=titan_moe.MoE.Config, exact=True,
          description="torchtitan's MoE run by shardmoe's MoE layer (shardmoe.torchtitan.MoE)")
def fused_moe(config: titan_moe.MoE.Config) -> MoE.Config:
    """The override a torchtitan config selects with --override.imports shardmoe.torchtitan.fused_moe:
    every torchtitan MoE.Config (exactly that class) becomes shardmoe.torchtitan.MoE.Config with the
    same fields, so the model builds the swapped module directly."""
    return derive(config, MoE.Config)


__all__ = ["MoE", "from_torchtitan", "fused_moe", "swap_moe"]
