"""One simulated point (a GPU count) and the aggregation that keeps 1024 GPUs under a minute.

Aggregation (what one simulated thing stands for), by `layout`:
  - expert parallelism spans ep = min(gpus, E) GPUs; the other gpus / ep are data-parallel copies
    of that group, identical within one MoE layer, so one group is simulated (their gradient
    all-reduce happens outside the layer and is not modelled);
  - above one node of expert-parallel GPUs one simulated device is a whole node (gpus_per_node GPUs, their
    experts, their SMs and links added): intra-node imbalance and NVLink traffic inside a node
    are not resolved there;
  - one simulated token stands for token_scale real tokens (a power of two, so at most
    MAX_TOKENS simulated tokens in all), and row tiles are sized so that one simulated row tile
    stands for one real 128-row tile per GPU it aggregates;
  - column tiles are coarse: a task covers its operand's whole width (the cost model counts the
    real 128-wide tiles inside it).
Routing: the same popularity drives both schedules; the bulk-synchronous baseline reads the
simulated plan's rows per (device, expert), scaled to real rows.
"""
from __future__ import annotations

import math
import time

import torch

from shardmoe.moe.config import MoEConfig
from shardmoe.simulate.tileless import simulate_backward, simulate_forward
from shardmoe.tasks.plan import Plan

from .baseline import bulk_synchronous, step_seconds, useful_flops
from .cost import CostScheduler
from .presets import Hardware, ModelShape
from .routing import popularity, routed_batch

MAX_TOKENS = 4096
AGGREGATE_ABOVE = 8
PROCESSORS = 8


def layout(gpus: int, shape: ModelShape, hw: Hardware) -> dict:
    """How `gpus` GPUs are simulated (module docstring): ep, replicas, devices, gpus per device,
    token scale, row tile size in simulated rows."""
    if gpus < 1:
        raise ValueError(f"--gpus: expected counts >= 1, got {gpus}")
    ep = min(gpus, shape.num_experts)
    if gpus % ep or shape.num_experts % ep:
        raise ValueError(f"--gpus {gpus}: the expert-parallel group min(gpus, E) = {ep} must divide both the "
                         f"GPU count and E = {shape.num_experts}")
    per_device = hw.gpus_per_node if ep > AGGREGATE_ABOVE and ep % hw.gpus_per_node == 0 else 1
    devices = ep // per_device
    real_tokens = ep * shape.tokens_per_gpu
    token_scale = 1 << max(0, math.ceil(math.log2(real_tokens / MAX_TOKENS)))
    block_m = max(1, hw.tile_rows * per_device // token_scale)
    return dict(ep=ep, replicas=gpus // ep, devices=devices, gpus_per_device=per_device, token_scale=token_scale,
                block_m=block_m, tokens=real_tokens // token_scale)


def _rows_per_device_expert(plan: Plan, scale: int) -> torch.Tensor:
    rows = torch.zeros(plan.peers, plan.config.num_experts, dtype=torch.float64)
    for tile in plan.row_tiles:
        rows[tile.peer, tile.expert] += tile.size * scale
    return rows


def simulate_point(gpus: int, shape: ModelShape, hw: Hardware, routing: str = "uniform", seed: int = 0) -> dict:
    """Both schedules at one GPU count: step seconds, fraction of peak, bytes per link class,
    overlap and the binding resource of the tile schedule; and the seconds the simulation took."""
    started = time.perf_counter()
    lay = layout(gpus, shape, hw)
    config = MoEConfig(shape.hidden_size, shape.ffn_size, shape.num_experts, shape.top_k)
    p = popularity(routing, shape.num_experts, seed)
    batch = routed_batch(p, lay["tokens"], shape.top_k, seed)
    ranks_per_node = 1 if lay["gpus_per_device"] > 1 else min(hw.gpus_per_node, lay["devices"])
    plan = Plan(config, batch, lay["tokens"], peers=lay["devices"], ranks_per_node=ranks_per_node,
                block_m=lay["block_m"], block_n=max(shape.hidden_size, shape.ffn_size))
    passes = [CostScheduler(plan, hw, gpus=lay["gpus_per_device"], token_scale=lay["token_scale"],
                            processors=PROCESSORS) for _ in range(2)]  # each pass starts at time 0
    forward, _ = simulate_forward(plan, passes[0], PROCESSORS)
    backward, _ = simulate_backward(plan, passes[1], PROCESSORS)
    rows = _rows_per_device_expert(plan, lay["token_scale"])
    phases = bulk_synchronous(rows, shape, hw, lay["gpus_per_device"], plan.node)
    gate = phases["forward gate"]  # routing precedes both schedules
    tile_step = gate + forward.makespan + backward.makespan
    bulk_step = step_seconds(phases)
    flops = useful_flops(rows, shape)
    peak = lay["ep"] * hw.peak_flops
    compute = sum(max(c.busy.values()) for c in passes) / PROCESSORS
    ports = {link: sum(c.port_seconds()[link] for c in passes) for link in ("nvlink", "fabric")}
    binding = max((("compute", compute), ("nvlink", ports["nvlink"]), ("fabric", ports["fabric"])),
                  key=lambda kv: kv[1])[0]
    return {
        "gpus": gpus, **lay,
        "tasks": len(forward.events) + len(backward.events),
        "tile_seconds": tile_step, "bulk_seconds": bulk_step, "speedup": bulk_step / tile_step,
        "tile_fraction_of_peak": flops / (tile_step * peak), "bulk_fraction_of_peak": flops / (bulk_step * peak),
        "link_bytes": {link: sum(c.link_bytes[link] for c in passes) for link in passes[0].link_bytes},
        "bulk_phases": phases,
        "tile_compute_seconds": compute,
        # share of the serial sum (compute + the busiest ports) that the overlap hid
        "tile_overlap": max(0.0, 1 - (forward.makespan + backward.makespan)
                            / (compute + ports["nvlink"] + ports["fabric"])),
        "tile_binding": binding,
        "simulated_in_seconds": time.perf_counter() - started,
    }
