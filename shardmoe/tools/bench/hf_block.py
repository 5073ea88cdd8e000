"""`shardmoe bench --hf FAMILY`: one decoder layer's sparse MoE block of a transformers family,
forward + backward, with its experts run by "shardmoe", "grouped_mm" and "eager".

The three candidates are the same block object (same weights, the family's own router and
shared experts), switched between experts implementations around each step; routing is fresh
(a new input every step, so every expert's row count changes, as in training). Timing is the
single-process bench's: interleaved rounds with a rotating order (shardmoe/tools/bench/timing.py).
The first pass checks the output and every gradient of "shardmoe" and "grouped_mm" against
"eager" (relative error, float norms). Reported: median ms per step and the ratios
median(other) / median(shardmoe) (above 1: shardmoe is faster).
With --model the family's whole causal LM is timed instead: shardmoe/tools/bench/hf_model.py.
"""
from __future__ import annotations

import statistics
import sys

from shardmoe.tools.bench.candidates import Candidate
from shardmoe.tools.bench.case import relative_error
from shardmoe.tools.bench.timing import time_interleaved
from shardmoe.hf.families import FAMILIES, small_config

IMPLEMENTATIONS = ("shardmoe", "grouped_mm", "eager")
DEFAULTS = dict(tokens=1024, hidden=256, ffn=256, experts=8, top_k=2, warmup=2, repeats=5)
QUICK = dict(tokens=256, hidden=64, ffn=64, warmup=1, repeats=2)


def family_block(family: str, dtype, seed: int = 0, **sizes):
    """The family's sparse MoE block built from a small config, every weight redrawn ~ N(0, 1/fan_in)
    (the blocks initialise some routers to zeros, which would route every token alike)."""
    import importlib

    import torch

    config = small_config(family, num_layers=1, **sizes)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    block = getattr(module, FAMILIES[family][1])(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5 if p.dim() > 1 else torch.zeros(p.shape))
    return block.to(dtype), config


def candidates(block, config, xs, grad_out):
    """One Candidate per implementation; each step takes the next input of xs (fresh routing)."""
    turn = {name: 0 for name in IMPLEMENTATIONS}
    params = list(block.parameters())

    def make(name):
        def run(x):
            config._experts_implementation = name
            out = block(x)
            out = out[0] if isinstance(out, tuple) else out  # GPT-OSS's block also returns its router scores
            out.backward(grad_out)
            return out

        def step():
            turn[name] += 1
            run(xs[1 + (turn[name] - 1) % (len(xs) - 1)])

        def reset():
            for p in params:
                p.grad = None
            for x in xs:
                x.grad = None

        def grads():
            return {"x": xs[0].grad, **{str(i): p.grad for i, p in enumerate(params)}}

        return Candidate(name, step, reset, tuple(params), forward=lambda: run(xs[0]), grads=grads)

    return {name: make(name) for name in IMPLEMENTATIONS}


def run_family(family: str, dtype_name: str, tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
               warmup: int, repeats: int) -> dict:
    """Build, check and time one family at one dtype; returns the table's numbers."""
    import torch

    import shardmoe.hf  # noqa: F401  (registers "shardmoe")

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    block, config = family_block(family, dtype, hidden_size=hidden, ffn_size=ffn, num_experts=experts,
                                 top_k=top_k)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, tokens, hidden, generator=gen).to(dtype).requires_grad_() for _ in range(warmup + repeats + 1)]
    grad_out = (torch.randn(1, tokens, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    cands = candidates(block, config, xs, grad_out)
    checked = {}
    for name, c in cands.items():
        c.reset()
        out = c.forward()
        checked[name] = {"y": out.detach(), **c.grads()}
        c.reset()
    times = time_interleaved(cands, warmup, repeats, "cpu")
    median = {n: statistics.median(t) for n, t in times.items()}
    return dict(family=family, dtype=dtype_name, shape=f"S={tokens} H={hidden} F={ffn} E={experts} k={top_k}",
                median_ms={n: 1e3 * m for n, m in median.items()},
                grouped_mm_over_shardmoe=median["grouped_mm"] / median["shardmoe"],
                eager_over_shardmoe=median["eager"] / median["shardmoe"],
                rel_err_vs_eager={n: relative_error(checked[n], checked["eager"])
                                  for n in ("shardmoe", "grouped_mm")},
                repeats=repeats)


def format_row(r: dict) -> str:
    ms = r["median_ms"]
    return (f"{r['family']:<12} {r['dtype']:<5} {ms['shardmoe']:9.2f} {ms['grouped_mm']:10.2f} {ms['eager']:9.2f} "
            f"{r['grouped_mm_over_shardmoe']:10.2f}x {r['eager_over_shardmoe']:8.2f}x "
            f"{r['rel_err_vs_eager']['shardmoe']:9.1e}")


HEADER = (f"{'family':<12} {'dtype':<5} {'shardmoe':>9} {'grouped_mm':>10} {'eager':>9} {'gmm/shard':>11} "
          f"{'eager/sh':>9} {'err/eager':>9}   (median ms per forward+backward)")


def refusal(args) -> str | None:
    """Why the --hf options cannot run (an unknown family, a device other than cpu), or None;
    shared with the whole-model mode (hf_model.py)."""
    if args.hf != "all" and args.hf not in FAMILIES:
        return f"--hf: expected one of {', '.join(FAMILIES)} or all, got {args.hf!r}"
    if args.device != "cpu":
        return f"--hf: expected --device cpu, got {args.device!r}"
    return None


def run(args) -> int:
    """The --hf path of `shardmoe bench`: args.hf names the family (or 'all')."""
    import torch

    refused = refusal(args)
    if refused:
        print(f"shardmoe bench: {refused}", file=sys.stderr)
        return 2
    families = list(FAMILIES) if args.hf == "all" else [args.hf]
    preset = dict(DEFAULTS, **(QUICK if args.quick else {}))
    sizes = {name: getattr(args, name, None) or preset[name]
             for name in ("tokens", "hidden", "ffn", "experts", "top_k")}
    warmup = args.warmup if args.warmup is not None else preset["warmup"]
    repeats = args.repeats if args.repeats is not None else preset["repeats"]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    print(f"shardmoe bench --hf: threads={torch.get_num_threads()}, fresh routing, "
          + " ".join(f"{k}={v}" for k, v in sizes.items()))
    print(HEADER)
    for family in families:
        for dtype_name in dtypes:
            try:
                row = run_family(family, dtype_name, warmup=warmup, repeats=repeats, **sizes)
            except ValueError as e:  # a refused family: say why
                print(f"shardmoe bench: --hf {family}: {e}", file=sys.stderr)
                return 2
            print(format_row(row), flush=True)
    return 0
