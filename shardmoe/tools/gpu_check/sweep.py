"""Stage sweep: the expert width F at which the Triton kernels stop beating the layer's torch path.

For each F in FFNS, at S=8192 H=4096 E=8 k=2 in bf16, one shardmoe.MoE with random weights
(bench.layer_candidate: no transformers block, no float64 truth) runs forward + backward of
L = sum(y * g) on its three paths, timed interleaved (shardmoe.tools.bench.timing.time_interleaved,
bench.WARMUP warm-up rounds then bench.REPEATS timed, each step between two CUDA events):
  shardmoe          the Triton path (forced: parity.triton_context)
  shardmoe:torch    kernels off
Per F the report gives each path's median step ms and
  torch/kernels     median(shardmoe:torch) / median(shardmoe)
above 1 the kernels win. The crossover is the largest F measured at which the kernels are at
least as fast as the torch path (torch/kernels >= 1), printed beside
kernels.KERNEL_MAX_FFN, the width past which CUDA layers take the torch path by default (not changed
here). Before timing at each F, one step on each path (it also autotunes the kernels at that F) is
checked: the kernel path within bench.CHECK_TOL of the torch path (bench.case.relative_error, the
largest over y, dL/dx and the three weight gradients), and the backends chosen triton, torch;
a miss is a problem (the stage fails) and the timing still runs. The layer is freed between F values;
the F values not started within the budget are listed as not run.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, replace

from shardmoe.tools.bench.flops import Shape

from . import bench
from .report import fmt, table

SHAPE = Shape(8192, 4096, 0, 8, 2)  # F from FFNS
FFNS = (512, 1024, 2048, 4096, 8192, 14336)
DRY_RUN_SHAPE = Shape(64, 32, 0, 4, 2)
DRY_RUN_FFNS = (16, 32, 48)
PATHS = bench.CHECKED  # shardmoe, shardmoe:torch


def measure(s: Shape, ctx) -> dict:
    """One F: the check, then the interleaved timing of PATHS."""
    import torch

    dtype, device, cuda = torch.bfloat16, ctx.device, ctx.device == "cuda"
    warmup, repeats = (bench.DRY_RUN_WARMUP, bench.DRY_RUN_REPEATS) if ctx.dry_run else (bench.WARMUP, bench.REPEATS)
    cand, _ = bench.layer_candidate(s, dtype, device)
    gen = torch.Generator().manual_seed(11)
    grad = (torch.randn(1, s.tokens, s.hidden, generator=gen) / s.hidden ** 0.5).to(device=device, dtype=dtype)
    steps_in = bench.contexts()
    chosen, wrong_backends = bench.chosen_backends(cand.layer.config, grad, steps_in)
    outputs = {name: bench.check_step(cand, steps_in[name], grad) for name in PATHS}
    errors, pair_problems = bench.pair_errors(outputs)  # the kernel path against the torch path
    del outputs
    bench.free(cuda)
    problems = [f"F={s.ffn}: {p}" for p in (*wrong_backends, *pair_problems)]
    clock = bench.Clock(cuda)
    _, kept_marks = bench.time_steps(dict.fromkeys(PATHS, cand), steps_in, grad, clock, warmup, repeats, device)
    median_ms = {name: statistics.median(clock.ms(a, b) for a, _, b in kept_marks[name]) for name in PATHS}
    del cand, kept_marks, grad
    bench.free(cuda)
    torch_ms = median_ms["shardmoe:torch"]
    return {"ffn": s.ffn, "median_ms": median_ms, "repeats": repeats, "backends": chosen, "errors": errors,
            "torch_over_kernels": torch_ms / median_ms["shardmoe"], "problems": problems}


def crossover(rows: list[dict]) -> int | None:
    """The largest F at which the kernels are at least as fast as the torch path; None when none is."""
    won = [r["ffn"] for r in rows if r["torch_over_kernels"] >= 1]
    return max(won, default=None)


def run(ctx) -> dict:
    from shardmoe.kernels import KERNEL_MAX_FFN

    base, ffns = (DRY_RUN_SHAPE, DRY_RUN_FFNS) if ctx.dry_run else (SHAPE, FFNS)
    result = {"shape": {k: v for k, v in asdict(base).items() if k != "ffn"}, "ffns": list(ffns), "dtype": "bf16",
              "warmup": bench.DRY_RUN_WARMUP if ctx.dry_run else bench.WARMUP,
              "timing": "CUDA events" if ctx.device == "cuda" else "perf_counter (CPU)",
              "check_tol": bench.CHECK_TOL, "kernel_max_ffn": KERNEL_MAX_FFN, "rows": [], "left_out": []}
    print(f"  {str(base).replace(' F=0', '')}, bf16, F in {ffns}", flush=True)
    for ffn in ffns:
        if ctx.out_of_time():
            result["left_out"].append(ffn)
            continue
        row = measure(replace(base, ffn=ffn), ctx)
        result["rows"].append(row)
        result["crossover_ffn"] = crossover(result["rows"])  # in each progress report
        print(f"  F={ffn}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in row["median_ms"].items())
              + f"; torch/kernels {row['torch_over_kernels']:.2f}"
              + "".join(f"\n  - {p}" for p in row["problems"]), flush=True)
        ctx.progress(result)
    result["crossover_ffn"] = crossover(result["rows"])
    result["passed"] = not any(r["problems"] for r in result["rows"]) and not result["left_out"]
    return result


def markdown(result: dict) -> list[str]:
    shape = result["shape"]
    rows = result["rows"]
    lines = [f"S={shape['tokens']} H={shape['hidden']} E={shape['experts']} k={shape['top_k']}, {result['dtype']}, "
             f"random weights; median step (forward + backward) of {rows[0]['repeats'] if rows else '-'} after "
             f"{result['warmup']} warm-up, {result['timing']}; a ratio above 1: the kernels win.", ""]
    lines += table(["F", "kernels ms", "torch ms", "torch/kernels"],
                   [[r["ffn"], fmt(r["median_ms"]["shardmoe"], ".2f"), fmt(r["median_ms"]["shardmoe:torch"], ".2f"),
                     fmt(r["torch_over_kernels"], ".2f")] for r in rows])
    cross, widest = result.get("crossover_ffn"), max((r["ffn"] for r in rows), default=None)
    if cross is None:
        found = "the torch path is faster than the kernels at every F measured"
    else:
        found = (f"the kernels are at least as fast as the torch path up to F={cross}"
                 + (" (the widest measured)" if cross == widest else ""))
    lines += ["", f"Measured crossover: {found}; kernels.KERNEL_MAX_FFN is {result['kernel_max_ffn']} "
              "(not changed by this stage).", ""]
    if rows:
        lines += ["Check before timing, error of the kernels against shardmoe:torch (<= "
                  f"{result['check_tol']:g}): " + ", ".join(
                      f"F={r['ffn']} " + " / ".join(f"{err:.1e}" for err in r["errors"].values()) for r in rows)
                  + "; backends " + ", ".join(sorted({"/".join(r["backends"].values()) for r in rows})) + ".", ""]
    lines += [f"- {p}" for r in rows for p in r["problems"]]
    if result.get("left_out"):
        lines += ["", f"Not run (budget spent): F = {', '.join(map(str, result['left_out']))}"]
    return lines
