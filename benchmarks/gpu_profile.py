"""Where one CUDA forward + backward of the layer spends its time: torch.profiler's kernel table.

    PYTHONPATH=. python benchmarks/gpu_profile.py S H F E k [--torch]

bf16, random weights and input, three warm-up steps (the first autotunes the kernels), then two
profiled steps; prints the 22 rows with the most CUDA time. The Triton path is forced
(kernels.force_kernel_path(), also past KERNEL_MAX_FFN); --torch profiles the torch path instead.
docs/gpu/2026-11-24-h100/profile-*.txt were made with it.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import shardmoe
from shardmoe import kernels, settings


def main(argv: list[str]) -> None:
    use_torch = "--torch" in argv
    tokens, hidden, ffn, experts, top_k = map(int, [a for a in argv if a != "--torch"])
    layer = shardmoe.MoE(hidden, ffn, experts, top_k, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16)
    path = settings.override(kernels=False) if use_torch else kernels.force_kernel_path()
    with path:
        for _ in range(3):
            layer(x).backward(grad)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                layer(x).backward(grad)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1:])
