"""Model FLOPs per token and the peak they are set against: the MFU of the progress bar and metrics.jsonl.

Model FLOPs (matmul multiply-adds x 2) per token of one forward, counting every query against all
L keys (the causal and document mask is not discounted, as in the PaLM definition):
    attention projections   2 M (Q K D) [q] + 2 M (2 K D) [k, v] + 2 (Q K D) M [o]
    scores and P.v          2 L (Q K D) + 2 L (Q K D)
    router                  2 M E
    experts (k per token)   k (2 M 2F + 2 F M)
    shared expert           2 M 2Fs + 2 Fs M (+ 2 M for its gate)
    unembedding             2 M V
A training step counts 3x the forward (the backward does two matmuls per forward matmul). The
backward's recomputations (logits, attention probabilities, checkpointed blocks) are hardware FLOPs, not model FLOPs,
so they do not count, as in the PaLM definition of MFU.

Peak (peak_flops), the denominator of MFU as people report it: on a GPU the device's dense
(no sparsity) bf16 tensor-core peak from its datasheet (DENSE_BF16_PEAKS), whatever dtype the run
trains in; a GPU the table does not name gets the best of a few bf16 matmuls measured on it. On
the CPU there is no spec sheet for a shared machine, so the peak is measured at start-up as the
best of a few matmuls of 1024 x 1024 in the run's compute dtype (float32, bf16 under autocast, or
float64), on the threads this process has. On a contended machine that figure already reflects
the contention, so MFU reads as "fraction of the matmul speed available right now".
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from shardmoe.model.transformer import TransformerConfig


def forward_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    """Model FLOPs of one forward pass per token (see the module docstring)."""
    moe = config.moe
    M, K, D, E, F = config.d_model, config.n_kv_heads, config.head_dim, moe.num_experts, moe.ffn_size
    heads = config.n_q_heads * D
    per_layer = (2 * M * heads + 2 * M * 2 * K * D + 2 * heads * M
                 + 4 * seq_len * heads
                 + 2 * M * E + moe.top_k * (2 * M * 2 * F + 2 * F * M)
                 + 6 * M * moe.shared_ffn_size + (2 * M if moe.shared_gate else 0))
    return config.n_layers * per_layer + 2 * M * config.vocab_size


def train_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    return 3 * forward_flops_per_token(config, seq_len)


# Dense bf16 tensor-core peaks, FLOP/s per GPU, by a lower-case substring of
# torch.cuda.get_device_name(), the more specific first. Each is the datasheet's "BF16 Tensor Core"
# figure, halved where the sheet gives it "with sparsity":
#   H100 SXM 989.4 T, H100 PCIe 756.5 T, H100 NVL 835.5 T: NVIDIA H100 Tensor Core GPU datasheet
#   H200 SXM 989.4 T, H200 NVL 835.5 T: NVIDIA H200 Tensor Core GPU datasheet (1,979 and 1,671 T with sparsity)
#   GH200 989.4 T: NVIDIA GH200 Grace Hopper Superchip datasheet (its H100-class GPU)
#   B200 2250 T: NVIDIA HGX B200 specifications (4.5 PFLOPS with sparsity per GPU)
#   A100 (SXM and PCIe) 312 T: NVIDIA A100 Tensor Core GPU datasheet
#   L40S 362.05 T: NVIDIA L40S datasheet (733 T with sparsity)
#   RTX 4090 165.2 T: NVIDIA Ada GPU architecture whitepaper, "Peak BF16 Tensor TFLOPS with FP32 Accumulate"
#   MI300X 1307.4 T: AMD Instinct MI300X data sheet (ROCm builds of torch show it as a cuda device)
DENSE_BF16_PEAKS = (
    ("h100 pcie", "H100 PCIe", 756.5e12),
    ("h100 nvl", "H100 NVL", 835.5e12),
    ("gh200", "GH200", 989.4e12),
    ("h100", "H100 SXM", 989.4e12),
    ("h200 nvl", "H200 NVL", 835.5e12),
    ("h200", "H200", 989.4e12),
    ("b200", "B200", 2250e12),
    ("a100", "A100", 312e12),
    ("l40s", "L40S", 362.05e12),
    ("rtx 4090", "RTX 4090", 165.2e12),
    ("mi300x", "MI300X", 1307.4e12),
)


class Peak(NamedTuple):
    """FLOP/s of one device, and where the figure comes from (for the run's summary)."""

    flops: float
    source: str


def known_peak(device_name: str) -> Peak | None:
    """The table's dense bf16 peak of a GPU by its name (torch.cuda.get_device_name), or None."""
    name = device_name.lower()
    for pattern, label, flops in DENSE_BF16_PEAKS:
        if pattern in name:
            return Peak(flops, f"the {label}'s dense bf16 peak of {flops / 1e12:.0f} TFLOP/s (datasheet)")
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> Peak:
    """The MFU denominator of a run on `device` in `dtype` (the module docstring)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = known_peak(name)
        if known is not None:
            return known
        flops = measure_peak_flops(torch.bfloat16, device=device, size=4096)
        return Peak(flops, f"a measured bf16 matmul peak of {flops / 1e12:.0f} TFLOP/s ({name} is not in the table)")
    flops = measure_peak_flops(dtype)
    return Peak(flops, f"a measured {flops / 1e9:.1f} GFLOP/s {str(dtype).removeprefix('torch.')} matmul peak per rank")


def measure_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 10,
                       device: torch.device | str = "cpu") -> float:
    """Best FLOP/s of `repeats` size x size matmuls in `dtype` on `device` (after one warm-up)."""
    device = torch.device(device)
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ a
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best
