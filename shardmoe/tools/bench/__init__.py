"""`shardmoe bench`: forward+backward of the MoE layer against its anchors.

One run times, side by side and interleaved on the same weights and input:
  transformers  transformers' MixtralSparseMoeBlock with experts_implementation="grouped_mm"
                (its fastest one on CPU; "batched_mm" gathers a [S*k, 2F, H] weight copy)
  loop          a per-expert-loop autograd baseline (index_select, F.linear, silu*up, index_add)
  dense         plain matmuls of the same FLOPs and shapes into preallocated buffers: the ceiling
  dense+alloc   the same matmuls allocating their outputs, as autograd does (allocator cost)
  shardmoe      shardmoe.MoE (the MoE operators, explicit backward)
and reports median time, GFLOP/s, the fraction of the dense ceiling, speedups, and the bytes
each layer saves for backward per token. Method and formulas: docs/benchmarks.md.

  flops        the named shapes (SHAPES, Shape) and their GEMM FLOPs
  saved_bytes  the bytes a forward keeps for its backward (saved_tensors_hooks)
  candidates   the five candidates above, each a step() of one forward + backward
  timing       interleaved rounds with rotating order, warm-up and a time budget
  case         one (shape, dtype) case: build, check against transformers, time; its rows and targets
  report       the legend, the tables, the targets line (--strict), the environment and the JSON file
  distributed  the expert-parallel layer on a mesh under torchrun (--mesh), its two exchange paths
  hf_block, hf_model  one transformers family's MoE block, or its whole causal LM (--hf, --model)
  pool_probe   memory per layer, a pool each or one shared (python -m shardmoe.tools.bench.pool_probe)
  this module  the subcommand: add_arguments(parser), run(args) -> exit code, main(argv)

A --mesh run (or a torchrun job) is handed to distributed.py.

Heavy imports (torch, transformers) happen inside functions, so `shardmoe --help` stays fast.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from shardmoe.tools.bench.candidates import CANDIDATES, VARIANTS
from shardmoe.tools.bench.case import run_case
from shardmoe.tools.bench.flops import SHAPES, Shape
from shardmoe.tools.bench.report import environment, format_case, format_targets, legend, write_json

QUICK_TOKENS = 512
QUICK_BUDGET_S = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"S={QUICK_TOKENS}, 1 warm-up, <= 3 repeats, {QUICK_BUDGET_S:g} s budget per case "
                             "(a smoke run)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--shapes", nargs="+", choices=(*SHAPES, "all"), default=["all"],
                        help="e8: S=4096 H=512 F=1024 E=8 k=2; e64: S=4096 H=512 F=128 E=64 k=2; "
                             "fine: S=4096 H=512 F=128 E=64 k=8")
    parser.add_argument("--tokens", type=int, default=None, help="override S (tokens) for every shape")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up rounds, the first being the saved-bytes/check pass (default 2, quick 1; "
                             "--hf: 2, quick 1; --hf --model: 2, quick 0)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7, quick 3; --hf: 5, quick 2; "
                                                                     "--hf --model: 15, quick 1)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="cap the timed rounds of each case at about this long: a slow candidate gets "
                             f"fewer repeats, at least 1 (default none, quick {QUICK_BUDGET_S:g})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads before timing (default: leave torch's setting as it is)")
    parser.add_argument("--candidates", nargs="+", choices=(*CANDIDATES, *VARIANTS), default=list(CANDIDATES),
                        help="the default five, and shardmoe's ablations " + ", ".join(VARIANTS))
    parser.add_argument("--routing", choices=("fixed", "fresh"), default="fresh",
                        help="fresh (default): a new input (new routing, new per-expert row counts) every "
                             "step, as in training; fixed: the same input every step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="PATH", default=None, help="write every number to this JSON file")
    parser.add_argument("--strict", action="store_true",
                        help="print the layer's targets (docs/benchmarks.md) and exit 1 when one is missed")
    parser.add_argument("--hf", metavar="FAMILY", default=None,
                        help="time one sparse MoE block of a transformers family (mixtral, qwen2_moe, qwen3_moe, "
                             "olmoe, deepseek_v3, gpt_oss, or all) with experts 'shardmoe' vs 'grouped_mm' vs "
                             "'eager' (shardmoe/tools/bench/hf_block.py); with --model, the family's whole causal LM")
    model = parser.add_argument_group(
        "whole-model mode (--hf FAMILY --model)",
        "one training step (forward with labels, loss.backward(), new random token ids every step) of the "
        "family's ForCausalLM built from its config, its experts run by 'shardmoe', 'grouped_mm' and 'eager' "
        "and through shardmoe.hf.convert ('convert'), each candidate on a model of its own (same weights); checked against eager (loss, "
        "gradients) before the interleaved timing (shardmoe/tools/bench/hf_model.py). Defaults B=4 L=512 H=512, "
        "2 layers, vocab 4096; mixtral-like experts F=1024 E=8 k=2 (qwen3_moe: F=128 E=64 k=8); "
        "--hidden/--ffn/--experts/--top-k override them, --tokens is refused (use --batch and --seq-len); "
        "2 warm-up and 15 timed rounds; --quick: B=2 L=16 H=64 F=32 vocab 128, no warm-up, 1 timed step")
    model.add_argument("--model", action="store_true", help="time the whole model instead of one block")
    model.add_argument("--batch", type=int, default=None, help="sequences per step B (default 4)")
    model.add_argument("--seq-len", type=int, default=None, help="tokens per sequence L (default 512)")
    model.add_argument("--layers", type=int, default=None, help="decoder layers (default 2)")
    model.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 4096)")
    # the distributed benchmark (`torchrun ... -m shardmoe bench --mesh e=4`) adds the options this
    # parser lacks (--mesh, --hidden, ...); run() hands a --mesh run (or a torchrun job) over to it
    from shardmoe.tools.bench import distributed

    distributed.add_arguments(parser)


def check_arguments(args: argparse.Namespace) -> None:
    """Input errors that surface late or not at all unless checked first: a size of 0 silently
    becomes the default, a negative one fails deep in torch, and --json into a missing directory
    fails only after the whole benchmark has run."""
    from shardmoe.arguments import check_at_least

    for name in ("tokens", "hidden", "ffn", "experts", "top_k"):
        if getattr(args, name, None) is not None:
            check_at_least("--" + name.replace("_", "-"), getattr(args, name), 1)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json: expected a file in an existing directory, got {args.json!r}")
    if getattr(args, "mesh", None) is not None:  # a rank traceback from Mesh() without torchrun
        from shardmoe.mesh import parse_mesh

        sizes = parse_mesh(args.mesh)
        ranks, world = sizes["d"] * sizes["e"] * sizes["t"], int(os.environ.get("WORLD_SIZE", "1"))
        if ranks != world:
            raise ValueError(f"--mesh {args.mesh}: expected a mesh of the world size {world}, got {ranks} rank(s): "
                             f"launch with torchrun --nproc-per-node {ranks} -m shardmoe bench --mesh {args.mesh}")


def _distributed_requested(args: argparse.Namespace) -> bool:
    return getattr(args, "mesh", None) is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1


def run(args: argparse.Namespace) -> int:
    # checked before the --mesh hand-over, which shares the option: torch.set_num_threads takes any
    # int, and a huge one crashes the process (100000 segfaulted)
    cores = os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= cores:
        print(f"shardmoe bench: --threads: expected an int in 1..{cores} (os.cpu_count()), got {args.threads}",
              file=sys.stderr)
        return 2
    if args.model and args.hf is None:
        print("shardmoe bench: --model: expected --hf FAMILY with it (the whole-model mode of the transformers "
              "bench), got no --hf", file=sys.stderr)
        return 2
    model_only = [f"--{name.replace('_', '-')} {getattr(args, name)}"
                  for name in ("batch", "seq_len", "layers", "vocab") if getattr(args, name) is not None]
    if model_only and not args.model:
        print(f"shardmoe bench: {model_only[0].split()[0]}: expected only with --hf FAMILY --model, got "
              f"{model_only[0]} without --model", file=sys.stderr)
        return 2
    if args.hf is not None:
        if args.model:
            from shardmoe.tools.bench import hf_model

            return hf_model.run(args)
        from shardmoe.tools.bench import hf_block

        return hf_block.run(args)
    if _distributed_requested(args):
        from shardmoe.tools.bench.distributed import run_distributed

        return run_distributed(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("shardmoe bench: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    shape_names = list(SHAPES) if "all" in args.shapes else list(dict.fromkeys(args.shapes))
    dtype_names = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    tokens = args.tokens if args.tokens is not None else (QUICK_TOKENS if args.quick else None)
    budget = args.budget if args.budget is not None else (QUICK_BUDGET_S if args.quick else None)
    if repeats < 1 or warmup < 0 or (tokens is not None and tokens < 1) or (budget is not None and not (
            math.isfinite(budget) and budget > 0)):  # NaN passes a <= 0 check
        print("shardmoe bench: expected --repeats >= 1, --warmup >= 0, --tokens >= 1, --budget a finite number > 0, "
              f"got --repeats {repeats}, --warmup {warmup}, --tokens {tokens}, --budget {budget}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    env = environment()
    print(f"shardmoe bench: device={args.device} threads={env['threads']} torch {env['torch']} "
          f"transformers {env['transformers']} cpu {env['cpu']} commit {env['commit']}")
    print(legend(dtype_names))
    results = []
    for shape_name in shape_names:
        S, H, F, E, k = SHAPES[shape_name]
        # --hidden/--ffn/--experts/--top-k (added with the distributed options) override a shape
        s = Shape(tokens if tokens is not None else S, getattr(args, "hidden", None) or H,
                  getattr(args, "ffn", None) or F, getattr(args, "experts", None) or E,
                  getattr(args, "top_k", None) or k)
        for dtype_name in dtype_names:
            r = run_case(shape_name, s, dtype_name, args.device, warmup, repeats, tuple(args.candidates), budget,
                         args.routing)
            results.append(r)
            print(format_case(r), flush=True)
    if args.strict:
        print(format_targets(results))
    if args.json:
        write_json(args.json, env, args.device, bool(args.quick), results)
        print(f"wrote {args.json}")
    missed = any(met is False for r in results for (_, _, met) in r.targets().values())
    return 1 if (args.strict and missed) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardmoe bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
    except ValueError as err:  # as the shardmoe command line reports it (cli.py)
        print(f"shardmoe bench: {err}", file=sys.stderr)
        return 2
    return run(args)

