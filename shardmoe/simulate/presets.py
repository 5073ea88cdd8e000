"""Presets of the simulator: the hardware (one H100 node type) and the MoE layer shapes, each
overridable field by field from the command line (--set name=value) or a TOML file.

Hardware constants (sources in docs/scale.md, "Constants and their sources"):
  peak_flops        dense bf16 tensor-core peak of one H100 SXM             989e12 FLOP/s
  gemm_efficiency   fraction of that peak one full tile reaches (assumed)   0.7
  hbm_bandwidth     HBM3 bandwidth of one H100 SXM                           3.35e12 B/s
  sms               streaming multiprocessors per H100 SXM                   132
  nvlink_bandwidth  NVLink 4, per GPU per direction (900 GB/s both ways)     450e9 B/s
  fabric_bandwidth  one 400 Gb/s NIC per GPU, per direction                  50e9 B/s
  nvlink_latency, fabric_latency  one small transfer's fixed cost (assumed)  2e-6 s, 5e-6 s
  gpus_per_node     8
  kernel_launch     one kernel boundary of the bulk-synchronous path (assumed)  5e-6 s
  host_sync         its device->host read of the all-to-all sizes, per pass (assumed)  30e-6 s
  memory_bytes      HBM of one H100 SXM                                       80e9 B
Model shapes (per MoE layer; tokens_per_gpu is the simulated micro-batch, an assumption):
  mixtral-8x7b   H 4096, F 14336, E 8,   k 2, 32 MoE layers (Mixtral-8x7B config)
  deepseek-v3    H 7168, F 2048,  E 256, k 8, 58 MoE layers (DeepSeek-V3 config: moe_intermediate_size,
                 61 layers of which the first 3 are dense)
  qwen3-moe      H 2048, F 768,   E 128, k 8, 48 MoE layers (Qwen3-30B-A3B config)
  batch_tokens, the global batch of a step that a pipelined layout splits into micro-batches
  (shardmoe/simulate/pipeline.py): 15360 sequences of 4096 tokens, DeepSeek-V3's (its report),
  assumed for the others too.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    peak_flops: float = 989e12
    gemm_efficiency: float = 0.7
    hbm_bandwidth: float = 3.35e12
    sms: int = 132
    nvlink_bandwidth: float = 450e9
    fabric_bandwidth: float = 50e9
    nvlink_latency: float = 2e-6
    fabric_latency: float = 5e-6
    gpus_per_node: int = 8
    tile_rows: int = 128  # BLOCK_M of a GEMM tile: a partial row tile costs a whole one
    bytes_per_element: int = 2  # bf16 activations
    kernel_launch: float = 5e-6  # one kernel launch/boundary of the bulk-synchronous path (assumed)
    host_sync: float = 30e-6  # the device->host copy of the all-to-all split sizes, per pass (assumed)
    memory_bytes: float = 80e9  # HBM per GPU: a pipelined layout must fit its experts' state and activations


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    ffn_size: int
    num_experts: int
    top_k: int
    tokens_per_gpu: int = 4096
    layers: int = 1  # MoE layers of the model, which a pipeline splits into stages
    batch_tokens: int = 15360 * 4096  # tokens of one step's global batch (DeepSeek-V3's)


HARDWARE = {"h100": Hardware()}
MODELS = {
    "mixtral-8x7b": ModelShape(4096, 14336, 8, 2, layers=32),
    "deepseek-v3": ModelShape(7168, 2048, 256, 8, layers=58),
    "qwen3-moe": ModelShape(2048, 768, 128, 8, layers=48),
}


def _override(preset, values: dict, source: str):
    """A copy of the dataclass `preset` with `values` (name -> value) set, each cast to the field's
    type; an unknown name or a value that does not cast raises ValueError naming the source."""
    types = {f.name: f.type for f in dataclasses.fields(preset)}
    cast = {}
    for name, value in values.items():
        if name not in types:
            raise ValueError(f"{source}: unknown setting {name!r}; expected one of {', '.join(types)}")
        kind = int if types[name] in (int, "int") else float
        try:
            cast[name] = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: {name} expected a {kind.__name__}, got {value!r}") from None
        if not math.isfinite(cast[name]) or cast[name] <= 0:  # NaN passes a <= 0 check
            raise ValueError(f"{source}: {name} expected a positive finite number, got {value!r}")
    return dataclasses.replace(preset, **cast)


def resolve(hardware: str, model: str, toml_path: str | None = None,
            settings: list[str] = ()) -> tuple[Hardware, ModelShape]:
    """The presets by name, then the TOML file's [hardware] and [model] tables, then `settings`
    ("name=value", the field found in whichever of the two dataclasses has it)."""
    if hardware not in HARDWARE:
        raise ValueError(f"--hardware: expected one of {', '.join(HARDWARE)}, got {hardware!r}")
    if model not in MODELS:
        raise ValueError(f"--preset: expected one of {', '.join(MODELS)}, got {model!r}")
    hw, shape = HARDWARE[hardware], MODELS[model]
    if toml_path is not None:
        table = tomllib.loads(Path(toml_path).read_text())
        unknown = sorted(set(table) - {"hardware", "model"})
        if unknown:
            raise ValueError(f"{toml_path}: expected tables [hardware] and [model], got {unknown}")
        hw = _override(hw, table.get("hardware", {}), f"{toml_path} [hardware]")
        shape = _override(shape, table.get("model", {}), f"{toml_path} [model]")
    for item in settings:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set: expected name=value, got {item!r}")
        if name in {f.name for f in dataclasses.fields(Hardware)}:
            hw = _override(hw, {name: value}, "--set")
        else:
            shape = _override(shape, {name: value}, "--set")
    return hw, shape
