"""What a run prints and writes: the columns' legend, one table per case, the targets line (with
--strict), the environment, JSON."""
from __future__ import annotations

import json
import platform
from dataclasses import asdict

from shardmoe.tools.bench.case import CaseResult
from shardmoe.tools.bench.flops import Shape


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


LEGEND = """\
columns: median ms, min ms: one forward + backward; GFLOP/s: its GEMM FLOPs per second;
  x dense: that over the dense ceiling (plain matmuls of the same FLOPs); vs tf, vs loop: speedup over
  transformers' block, over a per-expert loop; saved B/tok: bytes the forward keeps for the backward,
  per token; saved/tf: that over transformers'; ws B/tok: the layer's workspace (reused row buffers)
  per token; peak/tf: the step's peak allocation over transformers'; rel err: the largest relative
  L2 difference of output and gradients from transformers; n: timed rounds (docs/benchmarks.md)"""
BF16_NOTE = """\
bf16: shardmoe's rel err (about 0.1) is not its rounding: transformers computes the router logits in
  bf16, shardmoe in fp32, so the tokens near a tie pick another expert (fp32 agrees to 5e-7)"""


def legend(dtypes) -> str:
    """What the columns mean, and why bf16's rel err is large when bf16 is among `dtypes`."""
    return LEGEND + ("\n" + BF16_NOTE if "bf16" in dtypes else "")


def format_case(r: CaseResult) -> str:
    s = Shape(**r.shape)
    lines = [
        f"[{r.shape_name} {r.dtype}] {s}   GEMM FLOPs fwd+bwd {r.flops / 1e9:.2f} G "
        f"(experts {r.expert_flops / 1e9:.2f} + router {r.router_flops / 1e9:.2f}); "
        f"median of n timed rounds (<= {r.repeats}) after {r.warmup} warm-up; {r.routing} routing",
        f"  {'candidate':<22}{'median ms':>10}{'min ms':>9}{'GFLOP/s':>9}{'x dense':>9}{'vs tf':>7}"
        f"{'vs loop':>8}{'saved B/tok':>12}{'saved/tf':>9}{'ws B/tok':>9}{'peak/tf':>8}{'rel err':>9}{'n':>4}",
    ]
    for row in r.rows:
        lines.append(
            f"  {row.candidate:<22}{row.median_s * 1e3:>10.2f}{row.min_s * 1e3:>9.2f}{row.gflops:>9.1f}"
            f"{_fmt(row.fraction_of_dense, '.2f'):>9}{_fmt(row.speedup_vs_transformers, '.2f'):>7}"
            f"{_fmt(row.speedup_vs_loop, '.2f'):>8}{_fmt(row.saved_bytes_per_token, '.0f'):>12}"
            f"{_fmt(row.saved_vs_transformers, '.2f'):>9}{_fmt(row.workspace_bytes_per_token, '.0f'):>9}"
            f"{_fmt(row.peak_vs_transformers, '.2f'):>8}{_fmt(row.rel_err_vs_transformers, '.1e'):>9}{row.repeats:>4}"
        )
    return "\n".join(lines)


def format_targets(results: list[CaseResult]) -> str:
    lines = ["targets (shardmoe):"]
    for r in results:
        parts = []
        for key, (v, target, met) in r.targets().items():
            mark = "n/a" if met is None else ("ok" if met else "MISS")
            op = "<=" if key.startswith("saved") else ">="
            parts.append(f"{key} {_fmt(v, '.2f')} ({op} {target}) {mark}")
        lines.append(f"  {r.shape_name:<4} {r.dtype:<5} " + "; ".join(parts))
    return "\n".join(lines)


def environment() -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
           "machine": platform.machine(), "processor": platform.processor(), "transformers": transformers.__version__}
    try:
        import os
        import subprocess

        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        env["cpu"] = None
    return env


def write_json(path: str, env: dict, device: str, quick: bool, results: list[CaseResult]) -> None:
    """Every number of the run: the environment, the options that shape it, and each case."""
    with open(path, "w") as f:
        json.dump({"environment": env, "device": device, "quick": quick,
                   "cases": [asdict(r) for r in results]}, f, indent=2)
