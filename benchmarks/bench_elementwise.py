"""The fused CPU elementwise passes (shardmoe/moe/cpu.py) against today's torch path, in the
layer: one forward + backward of the same shardmoe.MoE (built from the bench's Mixtral block),
interleaved with the dense anchor and optionally transformers (shardmoe.bench's candidates and
timing), fresh routing. Prints median ratios, once per run.

  python benchmarks/bench_elementwise.py [--threads 2] [--runs 3] [--repeats 7] [--shapes e8 fine] [--transformers]

"torch path" is the same layer with settings.override(fused_elementwise=False) around its step.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess

import torch

from shardmoe import settings
from shardmoe.bench.candidates import Candidate, build_candidates
from shardmoe.bench.flops import Shape
from shardmoe.bench.timing import time_interleaved

SHAPES = {"e8": (4096, 512, 1024, 8, 2), "fine": (4096, 512, 256, 64, 4)}


def with_torch_elementwise(c: Candidate) -> Candidate:
    def step():
        with settings.override(fused_elementwise=False):
            c.step()
    return Candidate("torch path", step, c.reset, c.params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--transformers", action="store_true", help="also time transformers' block")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, threads {torch.get_num_threads()}, fresh routing, median of {args.repeats} rounds")
    for shape in args.shapes:
        tokens, hidden, ffn, experts, top_k = SHAPES[shape]
        s = Shape(tokens, hidden, ffn, experts, top_k)
        for dtype_name in args.dtypes:
            dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
            names = ["transformers"] * args.transformers + ["shardmoe", "dense"]
            cands, _ = build_candidates(s, dtype, "cpu", names, fresh_inputs=args.repeats + 2)
            cands["torch path"] = with_torch_elementwise(cands["shardmoe"])
            cands["fused"] = cands.pop("shardmoe")
            for run in range(args.runs):
                t = {n: statistics.median(v) for n, v in time_interleaved(cands, 2, args.repeats, "cpu").items()}
                line = (f"[{shape} {dtype_name}] S={tokens} H={hidden} F={ffn} E={experts} k={top_k} run {run}: "
                        f"fused {t['fused'] * 1e3:.1f} ms, torch path {t['torch path'] * 1e3:.1f} ms, "
                        f"speedup x{t['torch path'] / t['fused']:.2f}; x dense: fused {t['dense'] / t['fused']:.2f}, "
                        f"torch path {t['dense'] / t['torch path']:.2f}")
                if args.transformers:
                    line += (f"; vs transformers: fused x{t['transformers'] / t['fused']:.2f}, "
                             f"torch path x{t['transformers'] / t['torch path']:.2f}")
                print(line, flush=True)


if __name__ == "__main__":
    main()
