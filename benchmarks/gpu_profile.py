"""Where one CUDA forward + backward of the layer spends its time: torch.profiler's kernel table.

    PYTHONPATH=. python benchmarks/gpu_profile.py S H F E k [--torch]

bf16, random weights and input, three warm-up steps (the first autotunes the kernels), then two
profiled steps; prints the 22 rows with the most CUDA time. Each path runs in the GPU bench's
context for it (shardmoe.tools.gpu_check.bench.contexts()): the Triton path forced (also past
KERNEL_MAX_FFN); --torch the torch path instead.
docs/gpu/2026-11-24-h100/profile-*.txt were made with it.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import shardmoe
from shardmoe.tools.gpu_check.bench import contexts


def main(argv: list[str]) -> None:
    flags = {a for a in argv if a.startswith("--")}
    sizes = [a for a in argv if a not in flags]
    if len(sizes) != 5 or not flags <= {"--torch"}:
        sys.exit(f"gpu_profile.py: expected S H F E k and optionally --torch, got {' '.join(argv)!r}")
    tokens, hidden, ffn, experts, top_k = map(int, sizes)
    layer = shardmoe.MoE(hidden, ffn, experts, top_k, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16)
    path = "shardmoe:torch" if flags else "shardmoe"
    with contexts()[path]():
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
