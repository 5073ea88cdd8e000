"""Pipeline stages priced: a model of L MoE layers on G GPUs laid out as p pipeline stages x e
expert-parallel x d data-parallel ranks (p * e * d = G; p outermost, as shardmoe.Mesh lays it
out), under each schedule, with the one-layer step of the tile schedule or of the bulk-synchronous
baseline (sweep.simulate_point at e GPUs) as its unit of work.

Per step, the global batch of batch_tokens tokens is split over the d * e token-parallel ranks of
a stage and, on each, into m micro-batches of tokens_per_gpu tokens (the tokens one simulated
layer pass has per GPU):

    m = batch_tokens / (d e tokens_per_gpu)

A rank runs v chunks (v = 1 for gpipe and 1f1b, stages_per_rank for interleaved-1f1b), each of
ceil(L / (p v)) layers; one micro-batch's forward and backward through a chunk takes

    t_c = ceil(L / (p v)) * layer + 2 * x          (x: one activation transfer between stages)

layer: the simulated MoE layer's forward + backward at e GPUs; x: tokens_per_gpu * H * b bytes
over the link between consecutive stages (NVLink when the whole pipeline, p d e GPUs, fits a node;
else some boundary crosses nodes and, every chunk taking the same time here, the fabric's paces
them all) plus its latency, once forward (activations) and once backward (their gradients). The schedule then takes

    pipeline = (m v + p - 1) * t_c,    bubble = (p - 1) * t_c / pipeline = (p - 1) / (m v + p - 1)

(GPipe and 1F1B differ in memory, not time: both fill and drain p - 1 chunks; the interleaved
schedule's fill is p - 1 chunks of 1/v the work). After the last backward the expert gradients are
all-reduced over d (a ring: 2 (d - 1) / d of the rank's gradient bytes, over NVLink when the
stage fits a node, else the fabric), not overlapped:

    step = pipeline + allreduce,    tokens/s = batch_tokens / step

A layout must fit a GPU's memory: its expert parameters, (E / e) * ceil(L / p) * 3 H F, at
state_bytes_per_param (bf16 weight and gradient, float32 master weight and two AdamW moments: 16
bytes, assumed), plus the activations of the micro-batches in flight, each saving
b * (H + k (H + 2F)) bytes per token and layer (the layer's input, and per routed row its copy and
its 2F-wide pre-activation, as the MoE layer saves them): m of them for gpipe, p for 1f1b and
interleaved-1f1b (its first rank's warm-up). Attention, dense layers, shared experts and the
router are not modelled (the simulator prices the MoE layer), nor activation recomputation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardmoe.parallel.pipeline import SCHEDULES

from .presets import Hardware, ModelShape

STATE_BYTES_PER_PARAM = 16  # bf16 weight + bf16 gradient + float32 master weight + two float32 AdamW moments


@dataclass(frozen=True)
class PipelineLayout:
    """p pipeline stages x e expert-parallel x d data-parallel ranks, m micro-batches per step."""

    p: int
    e: int
    d: int
    microbatches: int


def pipeline_seconds(chunk_seconds: float, pipeline_size: int, chunks_per_rank: int,
                     microbatches: int) -> tuple[float, float]:
    """(seconds, bubble fraction) of one step's micro-batches through the schedule: (m v + p - 1)
    chunks of chunk_seconds each, of which p - 1 are the fill and drain."""
    slots = microbatches * chunks_per_rank + pipeline_size - 1
    return slots * chunk_seconds, (pipeline_size - 1) / slots


def layouts(gpus: int, shape: ModelShape) -> list[PipelineLayout]:
    """Every (p, e, d) with p * e * d = gpus, e dividing E, p at most L, and a whole number of
    micro-batches per token-parallel rank."""
    out = []
    for p in range(1, min(gpus, shape.layers) + 1):
        if gpus % p:
            continue
        for e in range(1, min(gpus // p, shape.num_experts) + 1):
            if (gpus // p) % e or shape.num_experts % e:
                continue
            d = gpus // (p * e)
            per_rank, left = divmod(shape.batch_tokens, d * e * shape.tokens_per_gpu)
            if per_rank >= 1 and not left:
                out.append(PipelineLayout(p, e, d, per_rank))
    return out


def expert_parameters(layout: PipelineLayout, shape: ModelShape) -> int:
    """The expert parameters one GPU holds: (E / e) * ceil(L / p) * 3 H F (its E / e experts' three
    H x F matrices in each of its stage's layers)."""
    return shape.num_experts // layout.e * math.ceil(shape.layers / layout.p) * 3 * shape.hidden_size * \
        shape.ffn_size


def memory_bytes(layout: PipelineLayout, schedule: str, shape: ModelShape, hw: Hardware) -> float:
    """Bytes one GPU holds: its experts' training state and the activations in flight."""
    H, F, k, b = shape.hidden_size, shape.ffn_size, shape.top_k, hw.bytes_per_element
    layers = math.ceil(shape.layers / layout.p)
    params = expert_parameters(layout, shape)
    in_flight = layout.microbatches if schedule == "gpipe" else min(layout.microbatches, layout.p)
    activations = in_flight * layers * shape.tokens_per_gpu * b * (H + k * (H + 2 * F))
    return params * STATE_BYTES_PER_PARAM + activations


def transfer_seconds(size: float, nvlink: bool, hw: Hardware) -> float:
    bandwidth, latency = (hw.nvlink_bandwidth, hw.nvlink_latency) if nvlink else (hw.fabric_bandwidth,
                                                                                  hw.fabric_latency)
    return size / bandwidth + latency


def price(layout: PipelineLayout, schedule: str, stages_per_rank: int, layer_seconds: float, shape: ModelShape,
          hw: Hardware) -> dict:
    """One layout under one schedule, its MoE layer taking layer_seconds (forward + backward of one
    micro-batch at e GPUs): step, pipeline and all-reduce seconds, bubble, tokens/s, memory."""
    v = stages_per_rank if schedule == "interleaved-1f1b" else 1
    stage_ranks = layout.d * layout.e
    in_node = layout.p * stage_ranks <= hw.gpus_per_node  # else some boundary between stages crosses nodes
    transfer = 0.0 if layout.p == 1 else \
        transfer_seconds(shape.tokens_per_gpu * shape.hidden_size * hw.bytes_per_element, in_node, hw)
    chunk = math.ceil(shape.layers / (layout.p * v)) * layer_seconds + 2 * transfer
    pipeline, bubble = pipeline_seconds(chunk, layout.p, v, layout.microbatches)
    gradient = expert_parameters(layout, shape) * hw.bytes_per_element
    allreduce = 0.0 if layout.d == 1 else transfer_seconds(2 * (layout.d - 1) / layout.d * gradient,
                                                           stage_ranks <= hw.gpus_per_node, hw)
    step = pipeline + allreduce
    memory = memory_bytes(layout, schedule, shape, hw)
    return {"p": layout.p, "e": layout.e, "d": layout.d, "microbatches": layout.microbatches, "schedule": schedule,
            "stages_per_rank": v, "chunk_seconds": chunk, "transfer_seconds": transfer,
            "pipeline_seconds": pipeline, "allreduce_seconds": allreduce, "step_seconds": step, "bubble": bubble,
            "tokens_per_s": shape.batch_tokens / step, "memory_bytes": memory, "fits": memory <= hw.memory_bytes}


def sweep_layouts(gpus: int, shape: ModelShape, hw: Hardware, layer: dict[int, dict], stages_per_rank: int = 2
                  ) -> list[dict]:
    """Every layout of `gpus` under every schedule, priced with the tile schedule's and the bulk-
    synchronous layer (layer: e -> simulate_point at e GPUs), fastest (tile) first. 1f1b needs
    m >= p, interleaved-1f1b p v <= L (torch's and the stage split's conditions)."""
    rows = []
    for layout in layouts(gpus, shape):
        for schedule in SCHEDULES:
            if schedule == "1f1b" and layout.microbatches < layout.p:
                continue
            if schedule == "interleaved-1f1b" and (layout.p == 1 or layout.p * stages_per_rank > shape.layers):
                continue
            tile = price(layout, schedule, stages_per_rank, layer[layout.e]["tile_seconds"], shape, hw)
            bulk = price(layout, schedule, stages_per_rank, layer[layout.e]["bulk_seconds"], shape, hw)
            rows.append({**tile, "bulk_step_seconds": bulk["step_seconds"], "bulk_tokens_per_s": bulk["tokens_per_s"]})
    return sorted(rows, key=lambda r: (not r["fits"], r["step_seconds"]))


def fastest(rows: list[dict]) -> dict | None:
    """The fastest layout that fits (rows as sweep_layouts orders them), or None."""
    return next((r for r in rows if r["fits"]), None)
