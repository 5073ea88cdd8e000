"""The bulk-synchronous baseline under the same cost model: what Megatron-style expert parallelism
does with the same routing on the same devices.

Forward: all-to-all dispatch -> grouped GEMMs of every local expert -> all-to-all combine.
Backward: all-to-all of the output gradients -> the backward GEMMs (twice the forward's: input
and weight gradients) -> all-to-all of the input gradients -> the gate GEMM. Each phase ends when
its slowest device ends (a collective or a kernel boundary waits for everyone).

rows [D, E] are the real rows device p sends to expert e (p a simulated device: a GPU, or a node
when aggregated). A device's all-to-all lasts max over its ports (egress and ingress per link
class, gpus * per-GPU bandwidth) of bytes / bandwidth, plus the latency of the slowest class it
uses. Its grouped GEMM pads each expert's rows to whole tiles (tile_rows) and runs at
gpus * peak * efficiency; elementwise passes (activation, combine, the gradient scalings) move
their bytes at gpus * HBM bandwidth, as the tile schedule's elementwise tasks do. What the tile
schedule does not pay and this path does: the permutations between token order and send order
(read + write of the rows, before the dispatch and after the combine), a kernel boundary per step
(FORWARD_KERNELS, BACKWARD_KERNELS, each hw.kernel_launch) and one host read of the all-to-all
sizes per pass (hw.host_sync), both assumptions written in docs/scale.md.
"""
from __future__ import annotations

import math

import torch

from .presets import Hardware, ModelShape

# kernel boundaries of one pass (router GEMM, top-k, count exchange, permute, all-to-all, GEMM,
# activation, GEMM, all-to-all, unpermute + combine; backward: those of the gradients, the weight
# gradients and the gate gradient), each a launch and a wait for the slowest rank
FORWARD_KERNELS = 10
BACKWARD_KERNELS = 16


def _all_to_all(bytes_sent: torch.Tensor, hw: Hardware, gpus: int, node_of) -> float:
    """Seconds of one all-to-all: bytes_sent [D, D] (source, destination), the slowest device."""
    devices = bytes_sent.shape[0]
    sent = bytes_sent.clone()
    # a node's own rows stay on the node; (gpus - 1) / gpus of them change GPU over NVLink
    sent.diagonal().mul_((gpus - 1) / gpus)
    worst = 0.0
    for d in range(devices):
        seconds, latency = 0.0, 0.0
        for link, bandwidth, lat in (("nvlink", hw.nvlink_bandwidth, hw.nvlink_latency),
                                     ("fabric", hw.fabric_bandwidth, hw.fabric_latency)):
            peers = [p for p in range(devices) if (node_of(p) != node_of(d)) == (link == "fabric")]
            out, into = float(sent[d, peers].sum()), float(sent[peers, d].sum())
            if out or into:
                seconds = max(seconds, max(out, into) / (gpus * bandwidth))
                latency = max(latency, lat)
        worst = max(worst, seconds + latency)
    return worst


def bulk_synchronous(rows: torch.Tensor, shape: ModelShape, hw: Hardware, gpus: int, node_of,
                     glu: bool = True) -> dict[str, float]:
    """Phase seconds (forward and backward) of one MoE layer step; rows [D, E] real rows."""
    devices, experts = rows.shape
    local = experts // devices
    H, F, b = shape.hidden_size, shape.ffn_size, hw.bytes_per_element
    up = 2 * F if glu else F
    rows_to_device = rows.reshape(devices, devices, local).sum(-1).double()  # [source, expert device]
    dispatch_bytes = rows_to_device * H * b
    a2a_dispatch = _all_to_all(dispatch_bytes, hw, gpus, node_of)
    a2a_combine = _all_to_all(dispatch_bytes.T.contiguous(), hw, gpus, node_of)

    per_expert = rows.sum(0).double()  # [E] rows each expert computes
    padded = torch.ceil(per_expert / hw.tile_rows) * hw.tile_rows
    flops_forward = 2 * padded * (H * up + F * H)  # [E]
    device_flops = flops_forward.reshape(devices, local).sum(-1)
    rate = gpus * hw.peak_flops * hw.gemm_efficiency
    gemm_forward = float(device_flops.max()) / rate
    device_rows = per_expert.reshape(devices, local).sum(-1)
    # activation (read h [2F], write a [F]) and the combine (3 passes over [rows, H]) per device
    elementwise_forward = float(device_rows.max()) * ((up + F) + 3 * H) * b / (gpus * hw.hbm_bandwidth)
    tokens_per_device = shape.tokens_per_gpu * gpus
    gate = 2 * tokens_per_device * H * experts / rate
    # token-order <-> send-order permutations, before the dispatch and after the combine:
    # read + write of [rows, H] each, on the device that sends the most rows
    permute = 2 * 2 * float(rows_to_device.sum(1).max()) * H * b / (gpus * hw.hbm_bandwidth)
    forward = {"gate": gate, "dispatch": a2a_dispatch, "experts": gemm_forward + elementwise_forward,
               "combine": a2a_combine, "permute": permute,
               "overheads": FORWARD_KERNELS * hw.kernel_launch + hw.host_sync}
    backward = {"dispatch": a2a_combine, "experts": 2 * gemm_forward + 2 * elementwise_forward,
                "combine": a2a_dispatch, "gate": 2 * gate, "permute": permute,
                "overheads": BACKWARD_KERNELS * hw.kernel_launch + hw.host_sync}
    return {**{f"forward {k}": v for k, v in forward.items()}, **{f"backward {k}": v for k, v in backward.items()}}


def useful_flops(rows: torch.Tensor, shape: ModelShape, glu: bool = True) -> float:
    """FLOPs of one forward + backward of the experts and the gate, without padding."""
    H, F, E = shape.hidden_size, shape.ffn_size, rows.shape[1]
    up = 2 * F if glu else F
    total_rows = float(rows.sum())
    tokens = total_rows / shape.top_k
    return 3 * 2 * total_rows * (H * up + F * H) + 3 * 2 * tokens * H * E


def step_seconds(phases: dict[str, float]) -> float:
    return math.fsum(phases.values())
