"""Stage static: every kernel a layer step launches, compiled for an H100 on this machine (no GPU
needed) by each Triton version the project meets (tritons.py: the Makefile's and the lent GPU
machine's), with its registers, spills, shared memory, HGMMA / TMA instruction counts and pipeline
structure (shardmoe/tools/gpu_check/compiled.py).

For each workload (WORKLOADS: the bench's two glu shapes, and an mlp and a GPT-OSS-like biased glu
for the other kernel variants) one forward and backward of the Triton backend, with the router's
three GEMMs (kernels/router_gemm.py), is traced on meta tensors with every launch compiled instead
of run, at the config an H100 runs (the tuned one for its key, else the first autotune candidate).
The work runs in one child process per Triton version, side by side
(`python -m shardmoe.tools.gpu_check.static OUT_JSON VERSION`), without TRITON_INTERPRET whatever the
parent's mode (a dry run's is the interpreter, whose kernels cannot compile); a version other than the
installed one is imported from its unpacked wheel (tritons.unpacked), and where it cannot be had (no
package index) the result says why in skipped_tritons.

Passes when, under every version compiled, every GEMM kernel (compiled.GEMM_KERNELS) was compiled and
each of its rows has tensor-core MMA (HGMMA > 0), no spills, at least MIN_BUFFERS shared-memory
buffers, a main-loop cp.async wait above 0 (loads in flight while the MMA runs; or no cp.async there
and TMA loads instead), and its column tile on program axis 0 (the one the hardware walks fastest).
Skipped, with the reason, where the toolchain is absent (triton without its NVIDIA backend, no
cuobjdump or nvdisasm).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from shardmoe.tools.bench.flops import Shape

from .bench import SHAPES
from .report import table

LIMIT_S = 600


@dataclass(frozen=True)
class Workload:
    name: str
    shape: Shape
    options: dict = field(default_factory=dict)  # MoEConfig's expert options

    def config(self):
        from shardmoe.moe.config import MoEConfig

        s = self.shape
        return MoEConfig(s.hidden, s.ffn, s.experts, s.top_k, **self.options)


WORKLOADS = (
    Workload("mixtral glu silu", SHAPES["mixtral"]),
    Workload("fine glu silu", SHAPES["fine"]),
    Workload("fine mlp gelu bias", SHAPES["fine"], dict(expert="mlp", activation="gelu", bias=True)),
    # GPT-OSS-20B's experts: biased glu, clamped SwiGLU (H=2880 F=2880 E=32 k=4)
    Workload("gpt-oss glu clamped bias", Shape(4096, 2880, 2880, 32, 4),
             dict(activation="clamped_swiglu", bias=True)),
)


MIN_BUFFERS = 3  # a load two steps ahead of the MMA and one being consumed


def compile_workloads() -> dict:
    """{"kernels": rows, ...} of every kernel WORKLOADS launch, compiled by the triton this process
    imports, or {"skipped": why}."""
    from shardmoe.tools.gpu_check import compiled

    tools, why = compiled.toolchain()
    if tools is None:
        return {"skipped": why}
    import triton

    with compiled.compile_only() as (found, workload):
        for w in WORKLOADS:
            workload["name"] = w.name
            compiled.trace_layer_step(w.config(), w.shape.tokens)
    return {"target": f"sm_{compiled.CAPABILITY}a", "device_name": compiled.H100, "triton": triton.__version__,
            "workloads": {w.name: str(w.shape) + (f" {w.options}" if w.options else "") for w in WORKLOADS},
            "kernels": [compiled.analyse(c, tools["disassembler"]) for c in found.values()]}


def compile_versions(root, out, timeout: float) -> dict:
    """Every Triton version (the installed one first, then tritons.VERSIONS) compiling WORKLOADS, one
    child process each, side by side: {"tritons": compiled versions, "skipped_tritons": {version: why},
    "kernels": every version's rows, ...}, or {"skipped": why} when none compiled. Each child's output
    goes to out/static-VERSION.log."""
    import time

    from . import tritons

    running = tritons.installed()
    versions = ([running] if running else []) + [v for v in tritons.VERSIONS if v != running]
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    children, skipped = {}, {}
    for version in versions:
        path, why = (None, None) if version == running else tritons.unpacked(version)
        if why:
            skipped[version] = why
            continue
        paths = [str(path)] if path else []
        env = dict(base, PYTHONPATH=os.pathsep.join(paths + [str(root)] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH")
                                                                            else [])))
        log = open(out / f"static-{version}.log", "w")
        children[version] = (subprocess.Popen([sys.executable, "-m", "shardmoe.tools.gpu_check.static",
                                               str(out / f"static-{version}.json"), version], cwd=root, env=env,
                                              stdout=log, stderr=subprocess.STDOUT, text=True), log)
    deadline = time.monotonic() + timeout
    results = {}
    for version, (child, log) in children.items():
        try:
            code = child.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            code = "killed after the stage's time limit"
        log.close()
        if code != 0:
            tail = (out / f"static-{version}.log").read_text()[-3000:]
            raise RuntimeError(f"python -m shardmoe.tools.gpu_check.static (triton {version}) exited {code}: {tail}")
        result = json.loads((out / f"static-{version}.json").read_text())
        if "skipped" in result:
            skipped[version] = result["skipped"]
        else:
            results[version] = result
    if not results:
        return {"skipped": "; ".join(f"triton {v}: {why}" for v, why in skipped.items()) or "no triton installed"}
    first = next(iter(results.values()))
    return {"target": first["target"], "device_name": first["device_name"], "tritons": list(results),
            "skipped_tritons": skipped, "workloads": first["workloads"],
            "kernels": [row for result in results.values() for row in result["kernels"]]}


def row_problems(r: dict) -> list[str]:
    """What one GEMM kernel row lacks of the structure the static stage holds (module docstring)."""
    found = []
    where = f"{r['name']} {r['config']} (triton {r.get('triton')}; {', '.join(r['workloads'])})"
    if not r["mma_instructions"]:
        found.append(f"{where}: expected tensor-core MMA (HGMMA), got none ({r['mma_sync_instructions']} HMMA)")
    if r["spill_bytes"] != 0:
        found.append(f"{where}: expected no spills, got {r['spill_bytes']} bytes ({r['registers']} registers)")
    if r["async_buffers"] < MIN_BUFFERS:
        found.append(f"{where}: expected at least {MIN_BUFFERS} shared-memory buffers, got {r['async_buffers']}")
    if r["async_wait"] == 0 or (r["async_wait"] is None and not r["tma_loads"]):
        found.append(f"{where}: expected a main-loop cp.async wait above 0 (or TMA loads), got {r['async_wait']}")
    if r["column_axis"] != 0:
        found.append(f"{where}: expected the column tile on program axis 0 (walked fastest), got {r['column_axis']}")
    elif r["column_axis"] not in r["program_axes"]:
        found.append(f"{where}: expected the column tile from program axis 0, the kernel reads axes "
                     f"{r['program_axes']}")
    return found


def problems(result: dict) -> list[str]:
    """Under each Triton compiled: every GEMM kernel compiled, each of its rows as row_problems holds."""
    from shardmoe.tools.gpu_check.compiled import GEMM_KERNELS

    rows = result["kernels"]
    found = []
    for version in result.get("tritons") or sorted({r.get("triton") for r in rows}, key=str):
        missing = sorted(set(GEMM_KERNELS) - {r["name"] for r in rows if r.get("triton") == version})
        if missing:
            found.append(f"triton {version}: GEMM kernels not compiled: {', '.join(missing)}")
    for r in rows:
        if r["gemm"]:
            found += row_problems(r)
    return found


def run(ctx) -> dict:
    if ctx.dry_run:
        return {"skipped": "not in a dry run: it needs no GPU and runs for real with "
                           "python -m shardmoe.tools.gpu_check --out DIR --only static"}
    result = compile_versions(ctx.root, ctx.out, LIMIT_S)
    if "skipped" in result:
        return result
    result["problems"] = problems(result)
    result["passed"] = not result["problems"]
    return result


def markdown(result: dict) -> list[str]:
    if "kernels" not in result:
        return []
    tritons = result.get("tritons") or [result.get("triton")]
    lines = [f"Compiled for {result['device_name']} ({result['target']}) by triton {', '.join(map(str, tritons))}, "
             f"no GPU: each kernel at the config a launch runs there (tuned, else the first candidate). Workloads: "
             + "; ".join(f"{name}: {shape}" for name, shape in result["workloads"].items()) + ".", ""]
    lines += [f"Not compiled by triton {v}: {why}" for v, why in result.get("skipped_tritons", {}).items()]
    lines += table(["kernel", "triton", "config", "variant", "workloads", "registers", "spill bytes", "shared bytes",
                    "HGMMA", "HMMA", "wgmma", "buffers", "cp.async wait", "wgmma wait", "TMA loads", "TMA stores",
                    "column axis"],
                   [[r["name"], r.get("triton"), " ".join(f"{k}={v}" for k, v in r["config"].items()),
                     " ".join(f"{k}={v}" for k, v in r["variant"].items() if not k.startswith("stride")),
                     ", ".join(r["workloads"]), r["registers"], r["spill_bytes"], r["shared_bytes"],
                     r["mma_instructions"], r["mma_sync_instructions"], r.get("wgmma"), r.get("async_buffers"),
                     r.get("async_wait"), r.get("wgmma_wait"), r.get("tma_loads"), r.get("tma_stores"),
                     r.get("column_axis")]
                    for r in result["kernels"]])
    lines += [""] + [f"- {p}" for p in result.get("problems", [])]
    return lines


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("python -m shardmoe.tools.gpu_check.static: expected the JSON file to write and optionally the triton "
              f"version to compile with, got {argv!r}", file=sys.stderr)
        return 2
    if len(argv) == 2:
        from . import tritons

        if tritons.installed() != argv[1]:
            print(f"python -m shardmoe.tools.gpu_check.static: expected triton {argv[1]} first on sys.path, got "
                  f"{tritons.installed()}", file=sys.stderr)
            return 2
    result = compile_workloads()
    with open(argv[0], "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"static: {len(result.get('kernels', []))} kernels compiled" if "kernels" in result
          else f"static: skipped: {result['skipped']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
