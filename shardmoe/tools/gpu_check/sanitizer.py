"""Stage sanitizer: the layer's Triton path under compute-sanitizer memcheck and racecheck.

  1. the workload (sanitize.py) once without a sanitizer: compiles and autotunes what it needs,
     leaving both in Triton's caches (TRITON_CACHE_AUTOTUNING=1), so step 2 only replays;
  2. `compute-sanitizer --tool TOOL python -m shardmoe.tools.gpu_check.sanitize` per tool in TOOLS, with
     PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is then its own cudaMalloc, so an access past
     a tensor's end is out of bounds for memcheck instead of landing in the caching allocator's
     block. Each tool's output goes to DIR/sanitizer-TOOL.log; the report keeps its summary
     line's counts and the first error lines.
Passes when every run exits 0, prints the workload's DONE_LINE, and its summary counts no error.

Without CUDA (a dry run) the sanitizer is skipped, and the workload runs in this process on CPU in
Triton's interpreter, so the script itself is checked; without compute-sanitizer on PATH the
stage is skipped after step 1.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

from .report import fmt, table
from .sanitize import DONE_LINE

# (tool, its options, time limit in seconds)
TOOLS = (("memcheck", ["--tool", "memcheck", "--leak-check", "no"], 240),
         ("racecheck", ["--tool", "racecheck"], 300))
PLAIN_LIMIT_S = 300  # step 1 on a bare machine compiles and autotunes every kernel it runs
WORKLOAD = ["-m", "shardmoe.tools.gpu_check.sanitize"]  # python's arguments that run the workload
# "========= ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
SUMMARIES = (re.compile(r"ERROR SUMMARY: (\d+) errors?"),
             re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, \d+ warnings?\)"))


def summary_errors(log: str) -> int | None:
    """The error count of the sanitizer's last summary line, None when it printed none."""
    counts = [int(m.group(1)) for pattern in SUMMARIES for m in pattern.finditer(log)]
    return max(counts) if counts else None


def error_lines(log: str, limit: int = 30) -> list[str]:
    """The sanitizer's report lines ("========= ..."), without its banner and summary."""
    lines = [ln.strip() for ln in log.splitlines() if ln.startswith("=========")]
    return [ln for ln in lines if "COMPUTE-SANITIZER" not in ln and "SUMMARY" not in ln and ln != "========="][:limit]


def _run(command: list[str], env: dict, limit: float, log_path) -> dict:
    start = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=limit)
        log, returncode, timed_out = done.stdout + done.stderr, done.returncode, False
    except subprocess.TimeoutExpired as err:
        # what the process wrote before it was stopped (bytes, even with text=True)
        log = "".join(part if isinstance(part, str) else (part or b"").decode(errors="replace")
                      for part in (err.stdout, err.stderr))
        returncode, timed_out = None, True
    log_path.write_text(log)
    return {"command": " ".join(command), "returncode": returncode, "timed_out": timed_out,
            "seconds": time.monotonic() - start, "completed": DONE_LINE in log, "log": log_path.name}


def run(ctx) -> dict:
    import torch

    if ctx.dry_run or not torch.cuda.is_available():
        from .sanitize import run_workload

        lines = run_workload("cpu", dry_run=True)
        return {"skipped": "no CUDA device (dry run): compute-sanitizer not run; its workload ran on CPU in "
                           "Triton's interpreter", "workload": lines}
    env = dict(os.environ, TRITON_CACHE_AUTOTUNING="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ctx.root), env.get("PYTHONPATH")) if p)
    workload = [sys.executable, *WORKLOAD]
    plain = _run(workload, env, ctx.limit(PLAIN_LIMIT_S), ctx.out / "sanitizer-plain.log")
    result = {"plain": plain, "tools": []}
    binary = shutil.which("compute-sanitizer")
    if binary is None:
        result["skipped"] = "compute-sanitizer is not on PATH: only the workload ran, without a sanitizer"
        result["passed"] = plain["returncode"] == 0 and plain["completed"]
        return result
    sanitized_env = dict(env, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    for tool, options, limit in TOOLS:
        if ctx.out_of_time():
            result["tools"].append({"tool": tool, "skipped": "budget spent"})
            continue
        print(f"  compute-sanitizer --tool {tool} ...", flush=True)
        entry = _run([binary, *options, *workload], sanitized_env, ctx.limit(limit), ctx.out / f"sanitizer-{tool}.log")
        text = (ctx.out / entry["log"]).read_text()
        entry.update(tool=tool, errors=summary_errors(text), first_errors=error_lines(text))
        result["tools"].append(entry)
        print(f"  {tool}: {entry['errors']} errors, exit {entry['returncode']}, {entry['seconds']:.0f} s", flush=True)
        ctx.progress(result)
    result["passed"] = (plain["returncode"] == 0 and plain["completed"]
                        and all(t.get("returncode") == 0 and t.get("completed") and t.get("errors") == 0
                                for t in result["tools"]))
    return result


def markdown(result: dict) -> list[str]:
    if "workload" in result:
        return ["Workload steps (CPU, interpreter):", ""] + [f"- {line}" for line in result["workload"]]
    plain = result["plain"]
    lines = table(["run", "exit", "completed", "errors", "seconds", "log"],
                  [["without sanitizer", plain["returncode"], plain["completed"], None, fmt(plain["seconds"], ".0f"),
                    plain["log"]]]
                  + [[t["tool"], t.get("returncode", t.get("skipped")), t.get("completed"), t.get("errors"),
                      fmt(t.get("seconds"), ".0f"), t.get("log")] for t in result["tools"]])
    for t in result["tools"]:
        if t.get("first_errors"):
            lines += ["", f"{t['tool']}, first reports:", "", "```", *t["first_errors"], "```"]
    return lines
