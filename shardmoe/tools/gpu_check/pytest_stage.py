"""Stage tests: the kernel and layer tests, compiled on CUDA.

Each file of tests/kernels is its own pytest process, and the layer's tests/moe files one more;
they run side by side (half the CPU cores), because on a bare machine each kernel variant is
compiled and autotuned on first use, and that is CPU work. Every process runs with
SHARDMOE_TEST_COMPILED=1 (tests/kernels/conftest.py: compiled kernels on CUDA tensors, no
interpreter) and TRITON_INTERPRET removed, writes a JUnit XML file and its output under
DIR/tests/, and is stopped at the stage's time limit (the budget's, if sooner); a stopped process
keeps the results its XML file has, or its output's tail.

In a dry run: two small files of tests/kernels, in the interpreter (SHARDMOE_TEST_COMPILED unset).
"""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from .report import fmt, table

# the layer's tests in tests/moe (on CPU tensors: the torch path and the wiring under this torch)
MOE_TESTS = ("test_layer.py", "test_function.py", "test_dispatch.py", "test_reference.py", "test_routing.py",
             "test_combine.py", "test_experts.py")
DRY_RUN_TESTS = ("tests/kernels/test_kernel_path.py", "tests/kernels/test_activations.py")
LIMIT_S = 480  # one process's time limit: a 10-minute lease command keeps two minutes for the rest
DRY_RUN_LIMIT_S = 120


def groups(root: Path, dry_run: bool) -> list[tuple[str, list[str]]]:
    """(name, test paths relative to root) of each pytest process."""
    if dry_run:
        return [("kernels-tiny", list(DRY_RUN_TESTS))]
    kernel_files = sorted((root / "tests" / "kernels").glob("test_*.py"))
    if not kernel_files:
        raise FileNotFoundError(f"tests: expected test files in {root / 'tests' / 'kernels'}, got none "
                                "(run from a working tree, not an installed package)")
    moe = [f"tests/moe/{name}" for name in MOE_TESTS if (root / "tests" / "moe" / name).exists()]
    # (pytest given no path would run the whole suite)
    return [(p.stem, [str(p.relative_to(root))]) for p in kernel_files] + ([("moe", moe)] if moe else [])


def environment(root: Path, dry_run: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "2"  # several processes share the cores
    env.pop("TRITON_INTERPRET", None)  # tests/kernels/conftest.py decides, from the switch below
    if dry_run:
        env.pop("SHARDMOE_TEST_COMPILED", None)
    else:
        env["SHARDMOE_TEST_COMPILED"] = "1"
    return env


def parse_junit(path: Path) -> dict:
    """Counts and the failing tests of one JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                failing.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                                "message": message[0][:300] if message else ""})
    skipped = sorted({(node.get("message") or "").strip()[:200] for node in root.iter("skipped")})
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failing": failing, "skip_reasons": skipped}


def run_group(ctx, out: Path, name: str, paths: list[str], env: dict, seconds: float) -> dict:
    """One pytest process, limited to `seconds` or the budget's remainder at its start (a queued
    process does not start once the budget is spent: its entry says so, as a timeout)."""
    xml, log = out / f"{name}.xml", out / f"{name}.log"
    if ctx.out_of_time():
        return {"name": name, "paths": paths, "returncode": None, "timed_out": True, "seconds": 0.0,
                "log": str(log.relative_to(out.parent)), "tail": "not started: the budget was spent"}
    limit = ctx.limit(seconds)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={xml}", *paths]
    start = time.monotonic()
    timed_out = False
    with open(log, "w") as sink:
        try:
            returncode = subprocess.run(command, cwd=ctx.root, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                        timeout=limit).returncode
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
    entry = {"name": name, "paths": paths, "returncode": returncode, "timed_out": timed_out,
             "seconds": time.monotonic() - start, "log": str(log.relative_to(out.parent))}
    if xml.exists():
        entry.update(parse_junit(xml))
    else:
        entry["tail"] = log.read_text()[-2000:]
    return entry


def run(ctx) -> dict:
    out = ctx.out / "tests"
    out.mkdir(parents=True, exist_ok=True)
    todo = groups(ctx.root, ctx.dry_run)
    env = environment(ctx.root, ctx.dry_run)
    seconds = DRY_RUN_LIMIT_S if ctx.dry_run else LIMIT_S
    workers = max(1, min(len(todo), (os.cpu_count() or 2) // 2))
    print(f"  {len(todo)} pytest processes, {workers} at a time, {ctx.limit(seconds):.0f} s each at most", flush=True)
    entries = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(run_group, ctx, out, name, paths, env, seconds) for name, paths in todo]
        for future in concurrent.futures.as_completed(futures):
            entries.append(future.result())
            e = entries[-1]
            print(f"  {e['name']}: {e.get('passed')} passed, {e.get('failures')} failed, {e.get('errors')} errors, "
                  f"{e.get('skipped')} skipped in {e['seconds']:.0f} s{' (timed out)' if e['timed_out'] else ''}",
                  flush=True)
            ctx.progress({"compiled": not ctx.dry_run, "groups": sorted(entries, key=lambda g: g["name"])})
    entries.sort(key=lambda g: g["name"])
    totals = {key: sum(e.get(key) or 0 for e in entries)
              for key in ("tests", "passed", "failures", "errors", "skipped")}
    passed = all(e["returncode"] == 0 and not e["timed_out"] for e in entries)
    return {"compiled": not ctx.dry_run, "groups": entries, "totals": totals, "passed": passed}


def markdown(result: dict) -> list[str]:
    mode = "compiled on CUDA (SHARDMOE_TEST_COMPILED=1)" if result.get("compiled") else "Triton interpreter on CPU"
    lines = [f"Mode: {mode}.", ""]
    lines += table(["process", "tests", "passed", "failed", "errors", "skipped", "seconds", "exit", "log"],
                   [[g["name"], g.get("tests"), g.get("passed"), g.get("failures"), g.get("errors"), g.get("skipped"),
                     fmt(g["seconds"], ".0f"), "timeout" if g["timed_out"] else g["returncode"], g["log"]]
                    for g in result.get("groups", [])])
    failing = [(g["name"], f) for g in result.get("groups", []) for f in g.get("failing", [])]
    if failing:
        lines += ["", "Failing tests:", ""]
        lines += table(["process", "test", "kind", "message"],
                       [[n, f["test"], f["kind"], f["message"]] for n, f in failing])
    reasons = sorted({r for g in result.get("groups", []) for r in g.get("skip_reasons", []) if r})
    if reasons:
        lines += ["", "Skip reasons: " + "; ".join(reasons)]
    for g in result.get("groups", []):
        if "tail" in g:
            lines += ["", f"{g['name']}: no JUnit file; the output's tail:", "", "```", g["tail"].rstrip(), "```"]
    return lines
