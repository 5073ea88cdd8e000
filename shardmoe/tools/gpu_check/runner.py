"""Runs the selected stages in order, each isolated: a stage that raises is recorded as failed with
its traceback and the next one runs; the report is rewritten after every stage.

A stage is a module with run(ctx: Context) -> dict and markdown(result: dict) -> list[str]. Its
result may say {"passed": False} (status failed: it ran, and a check it makes did not hold), else
{"skipped": "why"} (status skipped); otherwise the status is ok. On CUDA, DIR/tuned_configs.json is
rewritten after every stage with what the kernels' autotuning chose so far (write_tuned).
"""
from __future__ import annotations

import datetime
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from . import bench, calibrate, env, model, parity, pytest_stage, sanitizer, static, sweep, traffic, train
from .report import Report

# the order they run in, whatever the order --only names them in (calibrate reads bench's rates)
STAGES = {"env": env, "static": static, "traffic": traffic, "tests": pytest_stage, "sanitizer": sanitizer,
          "parity": parity, "train": train, "bench": bench, "sweep": sweep, "model": model, "calibrate": calibrate}
MARKDOWN = {name: module.markdown for name, module in STAGES.items()}


@dataclass
class Context:
    """What a stage gets: where to write, how to run, how long it may take, and the report so far."""

    out: Path
    dry_run: bool
    device: str  # "cuda", or "cpu" for a dry run (or a machine without CUDA)
    root: Path  # the working tree: tests/ and the shardmoe package under it
    deadline: float | None  # time.monotonic() after which the stage starts no new case or process
    report: Report
    stage: str = ""

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def limit(self, seconds: float) -> float:
        """A subprocess's timeout: `seconds`, or less when the budget ends sooner (at least 1 s)."""
        left = self.remaining()
        return seconds if left is None else max(1.0, min(seconds, left))

    def out_of_time(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

    def progress(self, partial: dict) -> None:
        """Record the stage's results so far (status running) and rewrite the report."""
        self.report.record(self.stage, "running", result=partial, note="cut short: these are partial results")
        self.report.write(MARKDOWN)


def write_tuned(out: Path) -> None:
    """DIR/tuned_configs.json: every config the kernels' autotuners chose in this process, for this
    device (python -m shardmoe.tools.gpu_check.tuned --merge takes it into shardmoe/kernels/tuned.py's
    table)."""
    from shardmoe import kernels

    if not kernels.triton_importable():
        return
    from shardmoe.kernels.tuning import current_device_name

    from . import tuned

    chosen = tuned.collect()
    if chosen:  # keyed by the name tuning.Prune looks the table up with
        tuned.write(out / "tuned_configs.json", current_device_name(), chosen)


def plan(stages: list[str], budget: float | None, shares: dict[str, float]) -> str:
    """One line: the stages in the order they run, each with its share of seconds, and the budget."""
    named = ", ".join(f"{n} ({shares[n]:g} s)" if n in shares else n for n in stages)
    return f"gpu_check: {named}; " + ("no budget" if budget is None else f"budget {budget:g} s")


def run(out: Path, stages: list[str], dry_run: bool, budget: float | None, merged: list[dict],
        argv: list[str], shares: dict[str, float] | None = None) -> int:
    """Run `stages` (names of STAGES) into `out`, in that order; 0 when none failed, 1 otherwise.
    A stage named in `shares` stops starting cases that many seconds after its start, or when the
    budget ends if that is sooner; the budget also keeps stages from starting."""
    import torch

    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    report = Report(out, {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                          "host": platform.node(), "device": device, "dry_run": dry_run, "argv": argv})
    existing = out / "report.json"
    if existing.exists():
        from .report import read

        report.merge(read(existing))
    for data in merged:
        report.merge(data)
    shares = shares or {}
    print(plan(stages, budget, shares), flush=True)
    ends = None if budget is None else time.monotonic() + budget
    # the working tree: this file is shardmoe/tools/gpu_check/runner.py under it
    ctx = Context(out, dry_run, device, Path(__file__).resolve().parents[3], ends, report)
    failed = False
    for name in stages:
        ctx.stage = name
        share_ends = time.monotonic() + shares[name] if name in shares else None
        ctx.deadline = min((t for t in (ends, share_ends) if t is not None), default=None)
        if ends is not None and time.monotonic() >= ends:
            report.record(name, "skipped", note=f"not started: the --budget of {budget:g} s was spent")
            report.write(MARKDOWN)
            continue
        print(f"gpu_check: {name} ...", flush=True)
        start = time.monotonic()
        try:
            result = STAGES[name].run(ctx)
        except Exception:  # recorded, and the next stage still runs
            partial = report.stages.get(name)  # what the stage reported before it raised, if anything
            kept = partial["result"] if partial and partial["status"] == "running" and partial["run"] == report.run \
                else None
            report.record(name, "failed", seconds=time.monotonic() - start, error=traceback.format_exc()[-6000:],
                          result=kept)
        else:
            status = "failed" if result.get("passed") is False else ("skipped" if result.get("skipped") else "ok")
            report.record(name, status, seconds=time.monotonic() - start, result=result, note=result.get("skipped"))
        failed |= report.stages[name]["status"] == "failed"
        report.write(MARKDOWN)
        if device == "cuda":
            write_tuned(out)
        entry = report.stages[name]
        print(f"gpu_check: {name} {entry['status']} in {entry['seconds']:.1f} s"
              + (f"\n{entry['error']}" if entry["error"] else ""), flush=True, file=sys.stdout)
    report.write(MARKDOWN)
    print(f"gpu_check: wrote {out / 'report.md'} and {out / 'report.json'}")
    return 1 if failed else 0
