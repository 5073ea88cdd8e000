"""Stage static: every kernel a layer step launches, compiled for an H100 on this machine (no GPU
needed), with its registers, spills, shared memory and HGMMA / TMA instruction counts
(shardmoe/tools/gpu_check/compiled.py).

For each workload (WORKLOADS: the bench's two glu shapes, and an mlp and a GPT-OSS-like biased glu
for the other kernel variants) one forward and backward of the Triton backend, with the router's
three GEMMs (kernels/router_gemm.py), is traced on meta tensors with every launch compiled instead
of run, at the config an H100 runs (the tuned one for its key, else the first autotune candidate).
The work runs in a child process (`python -m shardmoe.tools.gpu_check.static OUT_JSON`) without
TRITON_INTERPRET, whatever the parent's mode (a dry run's is the interpreter, whose kernels cannot
compile).

Passes when every GEMM kernel (compiled.GEMM_KERNELS) was compiled, and each of its rows has
tensor-core MMA (HGMMA > 0) and no spills. Skipped, with the reason, where the toolchain is absent
(triton without its NVIDIA backend, no cuobjdump or nvdisasm).
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


def compile_workloads() -> dict:
    """{"kernels": rows, ...} of every kernel WORKLOADS launch, or {"skipped": why}."""
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


def problems(result: dict) -> list[str]:
    """Every GEMM kernel compiled, each row with HGMMA and without spills."""
    from shardmoe.tools.gpu_check.compiled import GEMM_KERNELS

    rows = result["kernels"]
    found = []
    missing = sorted(set(GEMM_KERNELS) - {r["name"] for r in rows})
    if missing:
        found.append(f"GEMM kernels not compiled: {', '.join(missing)}")
    for r in rows:
        if not r["gemm"]:
            continue
        where = f"{r['name']} {r['config']} ({', '.join(r['workloads'])})"
        if not r["mma_instructions"]:
            found.append(f"{where}: expected tensor-core MMA (HGMMA), got none ({r['mma_sync_instructions']} HMMA)")
        if r["spill_bytes"] != 0:
            found.append(f"{where}: expected no spills, got {r['spill_bytes']} bytes ({r['registers']} registers)")
    return found


def run(ctx) -> dict:
    if ctx.dry_run:
        return {"skipped": "not in a dry run: it needs no GPU and runs for real with "
                           "python -m shardmoe.tools.gpu_check --out DIR --only static"}
    out = ctx.out / "static.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ctx.root), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "shardmoe.tools.gpu_check.static", str(out)], cwd=ctx.root, env=env,
                          capture_output=True, text=True, timeout=ctx.limit(LIMIT_S))
    (ctx.out / "static.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"python -m shardmoe.tools.gpu_check.static exited {done.returncode}: {done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if "skipped" in result:
        return result
    result["problems"] = problems(result)
    result["passed"] = not result["problems"]
    return result


def markdown(result: dict) -> list[str]:
    if "kernels" not in result:
        return []
    lines = [f"Compiled for {result['device_name']} ({result['target']}) by triton {result['triton']}, no GPU: "
             f"each kernel at the config a launch runs there (tuned, else the first candidate). Workloads: "
             + "; ".join(f"{name}: {shape}" for name, shape in result["workloads"].items()) + ".", ""]
    lines += table(["kernel", "config", "variant", "workloads", "registers", "spill bytes", "shared bytes", "HGMMA",
                    "HMMA", "TMA"],
                   [[r["name"], " ".join(f"{k}={v}" for k, v in r["config"].items()),
                     " ".join(f"{k}={v}" for k, v in r["variant"].items() if not k.startswith("stride")),
                     ", ".join(r["workloads"]), r["registers"], r["spill_bytes"], r["shared_bytes"],
                     r["mma_instructions"], r["mma_sync_instructions"], r["tma_instructions"]]
                    for r in result["kernels"]])
    lines += [""] + [f"- {p}" for p in result.get("problems", [])]
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("python -m shardmoe.tools.gpu_check.static: expected one argument, the JSON file to write, got "
              f"{argv!r}", file=sys.stderr)
        return 2
    result = compile_workloads()
    with open(argv[0], "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"static: {len(result.get('kernels', []))} kernels compiled" if "kernels" in result
          else f"static: skipped: {result['skipped']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
