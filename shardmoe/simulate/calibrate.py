"""`shardmoe simulate --calibrate`: does the cost model predict this machine?

Measures, on one thread per rank (as gloo ranks on this CPU run), the rates the model takes:
  peak_flops        fp32 GEMM [S k, H] x [H, 2F] (the experts' first GEMM), gemm_efficiency 1
  hbm_bandwidth     a copy of an [S k, H] fp32 tensor (read + write bytes / seconds)
  nvlink_bandwidth  the row exchange of the 2-rank expert-parallel layer (bytes sent per rank /
                    seconds; the two ranks share a node, so the model's intra-node link)
  nvlink_latency    the same exchange of one row
then predicts the bulk-synchronous step (baseline.py: the expert-parallel layer is that schedule)
of one MoE layer forward + backward at 1 and 2 ranks and prints it against the measured step of
shardmoe.MoE (mesh e=2 for two ranks, gloo), with the ratio. tile_rows is 1 (CPU GEMMs do not pad
to tiles) and kernel_launch / host_sync are 0: what the CPU path pays there is part of what is
compared.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from .baseline import bulk_synchronous, step_seconds
from .presets import Hardware, ModelShape

SHAPE = ModelShape(hidden_size=256, ffn_size=512, num_experts=8, top_k=2, tokens_per_gpu=1024)


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_rates(shape: ModelShape) -> dict[str, float]:
    """GEMM FLOP/s and copy bytes/s at the layer's shapes, one thread."""
    rows = shape.tokens_per_gpu * shape.top_k
    a = torch.randn(rows, shape.hidden_size)
    b = torch.randn(shape.hidden_size, 2 * shape.ffn_size)
    out = torch.empty(rows, 2 * shape.ffn_size)
    gemm = _median_seconds(lambda: torch.mm(a, b, out=out))
    copy_into = torch.empty_like(a)
    copy = _median_seconds(lambda: copy_into.copy_(a))
    return {"peak_flops": 2 * rows * shape.hidden_size * 2 * shape.ffn_size / gemm,
            "hbm_bandwidth": 2 * a.numel() * a.element_size() / copy}


def predicted_phases(shape: ModelShape, hardware: Hardware, ranks: int) -> dict[str, float]:
    """The baseline's phase seconds for `ranks` ranks on one node, uniform routing in expectation."""
    rows = torch.full((ranks, shape.num_experts), shape.tokens_per_gpu * shape.top_k / shape.num_experts,
                      dtype=torch.float64)
    return bulk_synchronous(rows, shape, hardware, 1, lambda rank: 0)


def predict(shape: ModelShape, hardware: Hardware, ranks: int) -> float:
    """The baseline's step seconds (predicted_phases summed)."""
    return step_seconds(predicted_phases(shape, hardware, ranks))


def _measured_step(shape: ModelShape, repeats: int) -> dict:
    """On each rank: the median forward + backward of shardmoe.MoE, and (2 ranks) the exchange."""
    import torch.distributed as dist

    import shardmoe
    from shardmoe.mesh import Mesh
    from shardmoe.parallel.bench import _time_exchange

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = Mesh(ep=world) if world > 1 else None
    torch.manual_seed(0)
    layer = shardmoe.MoE(shape.hidden_size, shape.ffn_size, shape.num_experts, shape.top_k, mesh=mesh)
    gen = torch.Generator().manual_seed(1 + (dist.get_rank() if world > 1 else 0))
    x = torch.randn(shape.tokens_per_gpu, shape.hidden_size, generator=gen)
    grad_out = torch.randn(shape.tokens_per_gpu, shape.hidden_size, generator=gen)

    def step():
        if world > 1:
            dist.barrier()
        layer(x).backward(grad_out)
        layer.zero_grad(set_to_none=True)

    result = {"step": _median_seconds(step, repeats)}
    if world > 1:  # the last step's phases, forward and backward together (the layer's own clock)
        result["phases"] = dict(layer.stats.get("seconds", {}))
        rows = shape.tokens_per_gpu * shape.top_k
        width = shape.hidden_size * 4
        result["exchange"] = _time_exchange(mesh, rows, width, repeats)
        result["exchange_bytes"] = rows // world * width * (world - 1)  # what one rank sends to its peer
        result["one_row"] = _time_exchange(mesh, world, width, repeats)
    return result


def calibrate(repeats: int = 7) -> tuple[dict, list[dict]]:
    """(the measured rates, one row per rank count: ranks, predicted and measured seconds, ratio,
    the predicted phases and the measured ones of the 2-rank layer)."""
    from shardmoe.testing.distributed import run_distributed

    torch.set_num_threads(1)
    rates = measure_rates(SHAPE)
    one = _measured_step(SHAPE, repeats)
    two = run_distributed(_measured_step, 2, (SHAPE, repeats))
    exchange = max(r["exchange"] for r in two)
    hardware = dataclasses.replace(
        Hardware(), peak_flops=rates["peak_flops"], gemm_efficiency=1.0, hbm_bandwidth=rates["hbm_bandwidth"],
        nvlink_bandwidth=two[0]["exchange_bytes"] / exchange, nvlink_latency=max(r["one_row"] for r in two),
        tile_rows=1, bytes_per_element=4, kernel_launch=0.0, host_sync=0.0, gpus_per_node=2)
    rows = []
    for ranks, measured in ((1, one["step"]), (2, max(r["step"] for r in two))):
        phases = predicted_phases(SHAPE, hardware, ranks)
        predicted = step_seconds(phases)
        rows.append({"ranks": ranks, "predicted_s": predicted, "measured_s": measured, "ratio": predicted / measured,
                     "phases": two[0]["phases"] if ranks == 2 else {}, "predicted_phases": phases})
    return {**rates, "link_bytes_per_s": hardware.nvlink_bandwidth, "link_latency_s": hardware.nvlink_latency}, rows
