"""`python -m shardmoe.tools.gpu_check --out DIR`: everything a short GPU lease should measure, in one command.

Stages (docs/gpu.md; --only picks some, they run in this order, except under --only lease):
  env        versions (python, torch, triton, transformers, CUDA, driver), the device, its memory
             and SMs; always runs, so every report says where it was measured
  static     every kernel a layer step launches, compiled for an H100 without a GPU by the installed
             triton and the lent machine's: registers, spills, shared memory, HGMMA and TMA
             instructions, pipeline buffers and waits, tile order (no CUDA needed: --only static)
  traffic    a memory-traffic model of one forward + backward at the bench's two shapes: FLOPs, the
             DRAM bytes the launch order implies, a roofline time for an H100 and an H200, calibrated
             against measured per-kernel times (no CUDA needed: --only traffic; on CUDA it also
             measures the kernels and shows measured and modelled side by side)
  tests      pytest on tests/kernels (compiled: SHARDMOE_TEST_COMPILED=1) and the layer's tests/moe
             files, one process per file, in parallel
  sanitizer  a small forward + backward of the layer on CUDA under compute-sanitizer memcheck and
             racecheck (the workload is shardmoe/tools/gpu_check/sanitize.py)
  parity     the Triton path against the float64 reference and the torch path, fp32 and bf16, over
             every router option, both expert kinds, an empty expert, S = 0, capacity drops
  train      `shardmoe train`'s loop on the GPU: the default preset and mixtral-1gpu (d_model 2048,
             8 experts top-2, 4 x 4096 tokens, bf16), 50 steps each: tokens/s, MFU, peak memory;
             the first losses against fp32 and against the CPU, a resume that continues bitwise
  bench      forward + backward at the Mixtral and a fine-grained shape, bf16, against dense
             matmuls of equal FLOPs, transformers' grouped_mm block and the layer's torch path
  sweep      the layer's Triton path against its torch path at F from 512 to 14336 (S=8192 H=4096
             E=8 k=2, bf16): the F up to which the kernels win, beside kernels.KERNEL_MAX_FFN
  model      a Qwen3-MoE-like transformers model (4 layers, H=2048 E=128 F=768 k=8, S=4096), one
             training step with experts_implementation="shardmoe" against "grouped_mm"
  calibrate  the simulator's hardware constants from the measured rates (DIR/calibrated.toml)
--only lease runs the lease's stages by priority instead (LEASE: what the issue's done-when reads
first), each under its share of seconds (LEASE_SHARES): a stage stops starting cases when its share
or the --budget is spent, so no one stage leaves the others nothing.
Each stage's failure is recorded (with its traceback) and the next still runs; DIR/report.md and
DIR/report.json are rewritten after every stage (report.py).

--dry-run runs the same code on CPU at tiny shapes, with the Triton kernels in Triton's
interpreter (the force_kernels setting, in a process started with TRITON_INTERPRET=1: the command
starts itself again with it when it was not set); the sanitizer stage then runs its
workload without a sanitizer and says so. It is the check that the command works (tests/tools/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# runner.STAGES, without its imports
STAGE_NAMES = ("env", "static", "traffic", "tests", "sanitizer", "parity", "train", "bench", "sweep", "model",
               "calibrate")
# --only lease: what one GPU lease runs in one command, most wanted first (docs/gpu.md, "Running it
# inside a short lease"): parity says whether any other figure means anything; bench holds the
# layer's speed and memory against grouped_mm and dense; traffic's measured kernel times (the
# weight gradient's TFLOP/s among them) calibrate the model and reuse bench's autotuning; model and
# train the whole-model figures; the sweep refines a threshold; static runs on any CPU too;
# calibrate reads bench's rates.
LEASE = ("parity", "bench", "traffic", "model", "train", "sweep", "static", "calibrate")
# seconds after its start at which a lease stage stops starting cases: each the stage's time on a
# bare H100 in docs/gpu.md's estimate with some margin; they sum past a --budget of 420 on purpose
# (the budget cuts the last ones, a stage that ends early leaves its rest to the next)
LEASE_SHARES = {"parity": 75, "bench": 180, "model": 75, "train": 120, "traffic": 120, "sweep": 60, "static": 60,
                "calibrate": 30}
NO_CUDA_STAGES = ("env", "static", "traffic")  # the stages a full run without CUDA may run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shardmoe.tools.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="DIR", default=None, help="directory for report.md and report.json (required)")
    parser.add_argument("--only", metavar="STAGE[,STAGE]", default=None,
                        help=f"run only these stages, comma-separated, among {', '.join(STAGE_NAMES)}, or lease "
                             f"({', '.join(LEASE)}); env always runs; default: all, or none with --merge")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, the Triton interpreter: checks the command, measures nothing")
    parser.add_argument("--budget", metavar="SECONDS", type=float, default=None,
                        help="start no stage, case or test process after this many seconds (a lease's limit)")
    parser.add_argument("--merge", metavar="REPORT_JSON", nargs="+", default=[],
                        help="first take the stages of these earlier report.json files (later ones win)")
    return parser


def parse_only(text: str | None, merging: bool) -> list[str]:
    """The stages to run, env first, then in STAGE_NAMES order, or with lease named LEASE's stages in
    LEASE's order and any others named after them; ValueError naming --only otherwise."""
    if text is None:
        return [] if merging else list(STAGE_NAMES)
    names = [part.strip() for part in text.split(",")]
    for name in names:
        if name not in STAGE_NAMES and name != "lease":
            raise ValueError(f"--only: expected comma-separated stage names among {', '.join(STAGE_NAMES)} "
                             f"(or lease), got {name!r} in {text!r}")
    lease = list(LEASE) if "lease" in names else []
    return ["env", *lease, *(n for n in STAGE_NAMES if n in names and n not in lease and n != "env")]


def check_arguments(args: argparse.Namespace) -> tuple[list[str], list[dict]]:
    """(stages to run, merged reports), or ValueError naming the argument, expected and actual value."""
    from shardmoe.arguments import check_at_least, check_out_dir

    from .report import read

    if not args.out:
        raise ValueError(f"--out: expected a directory for report.md and report.json, got {args.out!r}")
    stages = parse_only(args.only, bool(args.merge))
    if args.budget is not None:
        check_at_least("--budget", args.budget, 1)
    merged = []
    for path in args.merge:
        try:
            merged.append(read(Path(path)))
        except ValueError as err:
            raise ValueError(f"--merge: {err}") from None
    if not args.dry_run and set(stages) - set(NO_CUDA_STAGES):
        import torch

        if not torch.cuda.is_available():  # the full shapes would run for hours on a CPU
            raise ValueError(f"--dry-run: expected it on a machine without CUDA (torch.cuda.is_available() is False), "
                             f"got a full run of {','.join(stages)} (only {', '.join(NO_CUDA_STAGES)} run without it)")
    check_out_dir("--out", args.out)
    return stages, merged


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        stages, merged = check_arguments(args)
    except ValueError as err:
        print(f"python -m shardmoe.tools.gpu_check: {err}", file=sys.stderr)
        return 2
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # triton.jit reads TRITON_INTERPRET when a function is decorated, triton.language's own
        # included, and importing shardmoe already imported triton (torch's custom-op machinery
        # does): only a process started with it set runs every kernel in the interpreter
        if "triton" in sys.modules:
            return subprocess.call([sys.executable, "-m", "shardmoe.tools.gpu_check", *argv],
                                   env=dict(os.environ, TRITON_INTERPRET="1"))
        os.environ["TRITON_INTERPRET"] = "1"
    # autotune results kept on disk: the sanitizer's workload (another process) then reuses the
    # configs the parity stage tuned instead of benchmarking them under the sanitizer
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    from .runner import run

    shares = LEASE_SHARES if "lease" in (args.only or "").replace(" ", "").split(",") else None
    return run(Path(args.out), stages, args.dry_run, args.budget, merged, ["python -m shardmoe.tools.gpu_check", *argv],
               shares)
