"""What a new row count costs a bf16 GEMM on CPU: oneDNN builds a kernel (a primitive) per shape.

torch runs bf16 matmuls through oneDNN, which creates a primitive for each new (M, K, N, layout)
and keeps the last ONEDNN_PRIMITIVE_CACHE_CAPACITY (default 1024) of them. An MoE layer's expert
GEMMs take each expert's row count M, which changes every step. One thread, the GEMM into a reused
buffer (torch.mm(out=)), GFLOP/s of a sequence of calls:

  fixed          the same M every call (always cached)
  fresh, cold    M drawn from [180, 330] for each call (151 values: many calls meet a new one)
  fresh, warm    the same draws again: every shape cached
  many families  four (K, N) families at once, M from a range wide enough that their shapes
                 outnumber the cache (4 x 501 > 1024): the cache keeps evicting

  python benchmarks/onednn_shapes.py [--threads 1] [--dtype bf16|fp32]

--memory COUNT instead runs one GEMM of each of COUNT new shapes (the four families, M from 150 up)
and prints the growth of the process's peak resident memory per shape: what a cached kernel costs.
Set ONEDNN_PRIMITIVE_CACHE_CAPACITY at or above COUNT to keep them all.
"""
from __future__ import annotations

import argparse
import random
import resource
import time

import torch

# (K, N) of the fine shape's expert GEMMs (H = 512, F = 128): x Wgu^T, a Wdown^T, and the two
# input-gradient GEMMs dh Wgu, ge Wdown
FAMILIES = ((512, 256), (128, 512), (256, 512), (512, 128))


def gflops(calls, operands) -> float:
    """GFLOP/s of torch.mm(a[:m], w, out=o[:m]) for each (family, m) in calls."""
    flops, start = 0, time.perf_counter()
    for family, m in calls:
        a, w, o = operands[family]
        torch.mm(a[:m], w, out=o[:m])
        flops += 2 * m * w.shape[0] * w.shape[1]
    return flops / (time.perf_counter() - start) / 1e9


def memory_per_shape(count: int, dtype) -> None:
    """Growth of peak RSS over one GEMM of each of `count` new shapes, per shape."""
    rows = 150 + count // len(FAMILIES) + 1
    operands = {f: (torch.randn(rows, f[0], dtype=dtype), torch.randn(*f, dtype=dtype),
                    torch.empty(rows, f[1], dtype=dtype)) for f in FAMILIES}
    calls = [(FAMILIES[i % len(FAMILIES)], 150 + i // len(FAMILIES)) for i in range(count)]
    before = peak_resident_mib()
    gflops(calls, operands)
    grown = peak_resident_mib() - before
    print(f"{count} shapes: peak resident memory +{grown:.0f} MiB, {1024 * grown / count:.0f} KiB per shape")


def peak_resident_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--memory", type=int, metavar="COUNT", help="peak memory per kernel over COUNT shapes")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.memory:
        memory_per_shape(args.memory, dtype)
        return
    operands = {f: (torch.randn(700, f[0], dtype=dtype), torch.randn(*f, dtype=dtype),
                    torch.empty(700, f[1], dtype=dtype)) for f in FAMILIES}
    draw = random.Random(0)
    one = FAMILIES[0]
    print(f"onednn_shapes: {args.dtype} threads={args.threads} torch {torch.__version__}")
    gflops([(one, 256)] * 20, operands)
    print(f"fixed M=256, K={one[0]} N={one[1]}: {gflops([(one, 256)] * 300, operands):6.0f} GFLOP/s")
    fresh = [(one, draw.randint(180, 330)) for _ in range(300)]
    print(f"fresh M in [180, 330], cold:   {gflops(fresh, operands):6.0f} GFLOP/s")
    print(f"the same draws again, warm:   {gflops(fresh, operands):6.0f} GFLOP/s")
    for lo, hi in ((200, 300), (100, 600)):
        shapes = len(FAMILIES) * (hi - lo + 1)
        passes = []
        for _ in range(4):
            passes.append(gflops([(f, m) for m in (draw.randint(lo, hi) for _ in range(300)) for f in FAMILIES],
                                 operands))
        print(f"{len(FAMILIES)} families, M in [{lo}, {hi}] ({shapes} shapes), passes 1-4: "
              + " ".join(f"{g:6.0f}" for g in passes) + " GFLOP/s")


if __name__ == "__main__":
    main()
