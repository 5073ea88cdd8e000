"""Every autotune candidate of the GEMM kernels compiled for an H100 (no GPU needed): registers,
spills, shared memory and HGMMA count per candidate, at the GPU bench's two shapes (glu, SiLU, bf16).

    PYTHONPATH=. python benchmarks/static_candidates.py [--shape mixtral|fine]

`python -m shardmoe.tools.gpu_check --only static` compiles only the config each launch runs (the tuned
one, else the first candidate); this compiles them all, to keep candidates that spill out of the
lists (the autotuner would time them, and a tuned table could then hold one). Slow on two cores:
a few minutes per shape.
"""
import argparse

from shardmoe.tools.gpu_check.static import WORKLOADS
from shardmoe.tools.gpu_check import compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted({w.shape_name for w in WORKLOADS}), default=None)
    args = parser.parse_args()
    tools, why = compiled.toolchain()
    if tools is None:
        raise SystemExit(f"static_candidates.py: {why}")
    every = lambda tuner, name, named_args: tuner.configs if name in compiled.GEMM_KERNELS else []  # noqa: E731
    with compiled.compile_only(every) as (found, workload):
        for w in WORKLOADS:
            if args.shape in (None, w.shape_name):
                workload["name"] = w.name
                compiled.trace_layer_step(w.config(), w.tokens)
    print("| kernel | workloads | config | registers | spill bytes | shared bytes | HGMMA |")
    print("|---|---|---|---|---|---|---|")
    for c in found.values():
        row = compiled.analyse(c, tools["disassembler"])
        print(f"| {row['name']} | {', '.join(row['workloads'])} | {row['config']} | {row['registers']} | "
              f"{row['spill_bytes']} | {row['shared_bytes']} | {row['mma_instructions']} |")


if __name__ == "__main__":
    main()
