"""How fast the layer's expert GEMMs run inside a training step, and what share of the step they are.

One shape of the layer bench (shardmoe bench), bf16 or fp32, fresh routing every step: the six
side-by-side expert GEMM calls of a forward + backward (torch.ops.shardmoe_gemm.experts_mm for the
forward and input-gradient GEMMs, experts_weight_grad for the weight gradients) are timed one by one
(each call returns when its GEMMs are done), and their GFLOP/s printed beside the step time. The
dense anchor of the layer bench runs the same FLOPs as whole-batch GEMMs; the difference between
the step and the GEMMs is the routing, gathers, elementwise passes and combines.

Routing is fresh every step after 3 warm-up steps, so GEMM shapes met for the first time (in bf16
oneDNN builds a kernel for each, benchmarks/onednn_shapes.py) are inside the figures. The
side-by-side GEMMs need 2 or more threads and the built library; without them nothing is timed
and the script says so.

  python benchmarks/layer_gemm_rates.py --shape fine --tokens 2048 --dtype bf16 [--threads 2 --steps 8]
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from shardmoe.tools.bench.candidates import build_candidates
from shardmoe.tools.bench.flops import SHAPES, Shape, total_flops
from shardmoe.moe import cpu


def timed_gemms(stats: dict):
    """Wrappers of the two side-by-side GEMM operators adding (seconds, FLOPs) per call kind to stats."""
    experts_mm, experts_weight_grad = torch.ops.shardmoe_gemm.experts_mm, torch.ops.shardmoe_gemm.experts_weight_grad

    def mm(rows, weight, sizes, out):
        start = time.perf_counter()
        experts_mm(rows, weight, sizes, out)
        key = f"experts_mm [N,{rows.shape[1]}] x [E,{weight.shape[1]},{weight.shape[2]}]"
        stats[key][0] += time.perf_counter() - start
        stats[key][1] += 2 * rows.shape[0] * weight.shape[1] * weight.shape[2]

    def weight_grad(grad_rows, in_rows, sizes, out):
        start = time.perf_counter()
        experts_weight_grad(grad_rows, in_rows, sizes, out)
        key = f"experts_weight_grad [N,{grad_rows.shape[1]}]^T [N,{in_rows.shape[1]}]"
        stats[key][0] += time.perf_counter() - start
        stats[key][1] += 2 * grad_rows.shape[0] * grad_rows.shape[1] * in_rows.shape[1]

    return mm, weight_grad


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="fine")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    _, hidden, ffn, experts, top_k = SHAPES[args.shape]
    shape = Shape(args.tokens, hidden, ffn, experts, top_k)
    names = ["shardmoe", "dense"]
    cands = build_candidates(shape, dtype, "cpu", names, fresh_inputs=args.steps + 3)[0]
    stats = collections.defaultdict(lambda: [0.0, 0])
    if not cpu.library_loaded():
        raise SystemExit("layer_gemm_rates: the C++ library did not build: nothing to time")
    # the layer looks the operators up on torch.ops.shardmoe_gemm at each call (experts.TorchOps.linear)
    torch.ops.shardmoe_gemm.experts_mm, torch.ops.shardmoe_gemm.experts_weight_grad = timed_gemms(stats)
    seconds = {}
    for name in names:
        for _ in range(3):
            cands[name].reset()
            cands[name].step()
        stats.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            cands[name].reset()
            cands[name].step()
        seconds[name] = (time.perf_counter() - start) / args.steps
        if name == "shardmoe":
            calls = dict(stats)
    print(f"layer_gemm_rates: {args.shape} {shape} {args.dtype} threads={args.threads}, {args.steps} steps")
    if not calls:
        raise SystemExit("layer_gemm_rates: no side-by-side GEMM ran (one thread, SHARDMOE_EXPERTS_MM=0, or the "
                         "library did not build): nothing to report")
    print(f"step {1e3 * seconds['shardmoe']:.1f} ms; dense anchor {1e3 * seconds['dense']:.1f} ms, "
          f"{total_flops(shape) / seconds['dense'] / 1e9:.0f} GFLOP/s")
    total = 0.0
    for key, (s, flops) in calls.items():
        total += s / args.steps
        print(f"  {key:<48} {1e3 * s / args.steps:6.1f} ms/step {flops / s / 1e9:6.0f} GFLOP/s")
    print(f"expert GEMMs {1e3 * total:.1f} ms/step, {total / seconds['shardmoe']:.0%} of the step")


if __name__ == "__main__":
    main()
