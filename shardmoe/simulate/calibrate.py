"""`shardmoe simulate --calibrate`: does the cost model predict this machine?

Measures, on one thread per rank (as gloo ranks on this CPU run), the rates the model takes:
  peak_flops        the six fp32 GEMMs of each local expert's forward + backward, per expert with
                    its own weights at the mean row count (measure_rates); gemm_efficiency 1
  hbm_bandwidth     the bytes the layer's SiLU GLU pass moves per second (it reads [n, 2F] and
                    writes two [n, F]): the model prices elementwise work by bytes, and on this CPU
                    that pass is bound by its arithmetic at a quarter to two thirds of a plain copy's rate
                    (the copy rate is printed beside it)
  host_sync         half the step's fixed cost: the measured step at SMALL_TOKENS tokens minus
                    what the model predicts for it (Python, autograd, op dispatch, routing's
                    small ops; one host_sync is paid in forward, one in backward)
  nvlink_bandwidth  the row exchange of the 2-rank expert-parallel layer (bytes sent per rank /
                    seconds; the two ranks share a node, so the model's intra-node link)
  nvlink_latency    the same exchange of one row
The GEMM and elementwise rates are measured twice: alone (the device of the 1-rank prediction) and
on both ranks at once, each while its peer runs the same measurement (the device of the 2-rank
prediction, the slower rank's). Two processes on one small CPU share its caches and memory system;
a GPU does not slow its neighbour, but here the contended rate is the rate a rank has.
Then it predicts the bulk-synchronous step (baseline.py: the expert-parallel layer is that
schedule) of one MoE layer forward + backward at 1 and 2 ranks, with the experts' measured loads,
and prints it against the measured step of shardmoe.MoE (mesh e=2 for two ranks, gloo), with the
ratio. tile_rows is 1 (CPU GEMMs do not pad to tiles) and kernel_launch 0 (host_sync holds it).
Every constant is a measurement on this machine; none is fitted to the 1024-token step.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from shardmoe.moe.experts import glu_activation
from shardmoe.moe.cpu import CpuOps, Workspace

from .baseline import bulk_synchronous, step_seconds
from .presets import Hardware, ModelShape

SHAPE = ModelShape(hidden_size=256, ffn_size=512, num_experts=8, top_k=2, tokens_per_gpu=1024)
SMALL_TOKENS = 8  # the step whose work is negligible: what it takes is the fixed cost per step


def _median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_rates(shape: ModelShape, ranks: int = 1) -> dict[str, float]:
    """GEMM FLOP/s, copy bytes/s and elementwise (SiLU GLU pass) bytes/s at the layer's shapes, one
    thread. The GEMM rate is that of the
    six GEMMs of a glu forward + backward, run as the layer runs them: per expert, for the E / ranks
    experts of one rank, each with its own weights and the mean rows an expert gets (ranks S k / E),
    so operands stream through the caches as in a step rather than staying hot:
      forward   h = x W1 [n, H] x [H, 2F]         y = a W2 [n, F] x [F, H]
      backward  da = g W2^T [n, H] x [H, F]       dW2 = a^T g [F, n] x [n, H]
                dx = dh W1^T [n, 2F] x [2F, H]    dW1 = x^T dh [H, n] x [n, 2F]"""
    n = ranks * shape.tokens_per_gpu * shape.top_k // shape.num_experts
    H, F = shape.hidden_size, shape.ffn_size

    def expert_products():
        x, g, a, dh = torch.randn(n, H), torch.randn(n, H), torch.randn(n, F), torch.randn(n, 2 * F)
        w1, w2 = torch.randn(H, 2 * F), torch.randn(F, H)
        return [(x, w1), (a, w2), (g, w2.t()), (a.t(), g), (dh, w1.t()), (x.t(), dh)]

    products = [p for _ in range(shape.num_experts // ranks) for p in expert_products()]
    outs = [torch.empty(left.shape[0], right.shape[1]) for left, right in products]

    def gemms():
        for (left, right), out in zip(products, outs):
            torch.mm(left, right, out=out)

    gemm = _median_seconds(gemms)
    flops = sum(2 * left.shape[0] * left.shape[1] * right.shape[1] for left, right in products)
    rows = shape.tokens_per_gpu * shape.top_k
    a = torch.randn(rows, H)
    copy_into = torch.empty_like(a)
    copy = _median_seconds(lambda: copy_into.copy_(a))
    h = torch.randn(rows, 2 * F)
    ops = CpuOps.decide(h, Workspace())  # the layer's own CPU primitives
    activation = _median_seconds(lambda: glu_activation(ops, h, "silu"))
    return {"peak_flops": flops / gemm, "copy_bandwidth": 2 * a.numel() * a.element_size() / copy,
            "hbm_bandwidth": glu_pass_bytes(h) / activation}


def glu_pass_bytes(h) -> int:
    """Bytes the SiLU GLU pass (experts.glu_activation) moves for h [n, 2F]: it reads h and writes
    a and act(gate), two [n, F]: 2 h.numel() elements."""
    return 2 * h.numel() * h.element_size()


def predicted_phases(shape: ModelShape, hardware: Hardware, ranks: int,
                     per_expert: torch.Tensor | None = None) -> dict[str, float]:
    """The baseline's phase seconds for `ranks` ranks on one node. per_expert [E]: rows each expert
    received in the measured step (all ranks together), split evenly over the source ranks;
    None: uniform routing in expectation."""
    if per_expert is None:
        per_expert = torch.full((shape.num_experts,), ranks * shape.tokens_per_gpu * shape.top_k / shape.num_experts)
    rows = (per_expert.double() / ranks).expand(ranks, -1)  # [source rank, E]
    return bulk_synchronous(rows, shape, hardware, 1, lambda rank: 0)


def predict(shape: ModelShape, hardware: Hardware, ranks: int) -> float:
    """The baseline's step seconds (predicted_phases summed)."""
    return step_seconds(predicted_phases(shape, hardware, ranks))


def _measured_step(shape: ModelShape, repeats: int) -> dict:
    """On each rank: the median forward + backward of shardmoe.MoE, and (2 ranks) the exchange."""
    import torch.distributed as dist

    import shardmoe
    from shardmoe.mesh import Mesh
    from shardmoe.parallel.exchange import time_exchange

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = Mesh(ep=world) if world > 1 else None
    torch.manual_seed(0)
    layer = shardmoe.MoE(shape.hidden_size, shape.ffn_size, shape.num_experts, shape.top_k, mesh=mesh)
    gen = torch.Generator().manual_seed(1 + (dist.get_rank() if world > 1 else 0))
    x = torch.randn(shape.tokens_per_gpu, shape.hidden_size, generator=gen)
    grad_out = torch.randn(shape.tokens_per_gpu, shape.hidden_size, generator=gen)

    def step(tokens: int):
        if world > 1:
            dist.barrier()
        layer(x[:tokens]).backward(grad_out[:tokens])
        layer.zero_grad(set_to_none=True)

    result = {"step": _median_seconds(lambda: step(len(x)), repeats),
              "per_expert": layer.stats["tokens_per_expert"].tolist(),
              # the last step's phases, forward and backward together (the layer's own clock)
              "phases": dict(layer.stats.get("seconds", {})),
              "small_step": _median_seconds(lambda: step(SMALL_TOKENS), repeats),
              "small_per_expert": layer.stats["tokens_per_expert"].tolist()}
    if world > 1:
        dist.barrier()  # both ranks measure at once: each rate is one rank's while its peer works too
        result["rates"] = measure_rates(shape, world)
        rows = shape.tokens_per_gpu * shape.top_k
        width = shape.hidden_size * 4
        result["exchange"] = time_exchange(mesh, rows, width, repeats)
        result["exchange_bytes"] = rows // world * width * (world - 1)  # what one rank sends to its peer
        result["one_row"] = time_exchange(mesh, world, width, repeats)
    return result


def _host_overhead(hardware: Hardware, ranks: int, measured: dict) -> float:
    """The step's fixed cost the model does not price from bytes and FLOPs (Python, autograd, op
    dispatch, the routing's small ops): the measured step at SMALL_TOKENS tokens per rank minus
    its predicted step at the same rates, >= 0. On a GPU this is what kernel_launch and host_sync
    stand for."""
    small = dataclasses.replace(SHAPE, tokens_per_gpu=SMALL_TOKENS)
    predicted = step_seconds(predicted_phases(small, hardware, ranks, torch.tensor(measured["small_per_expert"])))
    return max(0.0, measured["small_step"] - predicted)


def calibrate(repeats: int = 7) -> tuple[dict, list[dict]]:
    """(the measured rates, one row per rank count: ranks, predicted and measured seconds, ratio,
    the predicted phases and the measured ones of the 2-rank layer)."""
    from shardmoe.testing.distributed import run_distributed

    torch.set_num_threads(1)
    rates = measure_rates(SHAPE)
    one = _measured_step(SHAPE, repeats)
    two = run_distributed(_measured_step, 2, (SHAPE, repeats))
    exchange = max(r["exchange"] for r in two)
    # the slower rank's rates: the bulk-synchronous phases wait for it
    together = {name: min(r["rates"][name] for r in two) for name in rates}
    link = dict(nvlink_bandwidth=two[0]["exchange_bytes"] / exchange, nvlink_latency=max(r["one_row"] for r in two),
                tile_rows=1, bytes_per_element=4, kernel_launch=0.0, host_sync=0.0, gpus_per_node=2)
    rows = []
    for ranks, measured, device in ((1, one, rates), (2, two[0], together)):
        hardware = dataclasses.replace(Hardware(), peak_flops=device["peak_flops"], gemm_efficiency=1.0,
                                       hbm_bandwidth=device["hbm_bandwidth"], **link)
        # host_sync is paid once in forward, once in backward
        overhead = max(_host_overhead(hardware, ranks, r) for r in ((one,) if ranks == 1 else two))
        hardware = dataclasses.replace(hardware, host_sync=overhead / 2)
        phases = predicted_phases(SHAPE, hardware, ranks, torch.tensor(measured["per_expert"]))
        predicted = step_seconds(phases)
        step = measured["step"] if ranks == 1 else max(r["step"] for r in two)
        rows.append({"ranks": ranks, "predicted_s": predicted, "measured_s": step, "ratio": predicted / step,
                     "rates": {**device, "host_overhead": overhead}, "phases": measured["phases"] if ranks > 1 else {},
                     "predicted_phases": phases})
    return {**rates, "link_bytes_per_s": link["nvlink_bandwidth"], "link_latency_s": link["nvlink_latency"]}, rows
