"""One whole-model candidate alone in its process, for comparisons the shared bench can blur.

`shardmoe bench --hf FAMILY --model` runs its candidates interleaved in one process, so in bf16
they share oneDNN's kernel cache (benchmarks/onednn_shapes.py): a kernel one candidate built can
serve another, or one candidate's shapes evict another's. This script times one candidate with
nothing else in the process: the bench's model (same sizes, weights and token batches), its
experts run by CANDIDATE ('shardmoe', 'grouped_mm', 'eager') or converted ('convert'); median ms
of the timed steps after the warm-up ones (the bench's batches, less its checked step), and the process's peak resident memory (in bf16 it
includes oneDNN's cached kernels, ~0.65 MiB each). Run candidates one after another and alternate them.

  python benchmarks/model_alone.py --family qwen3_moe --dtype bf16 --candidate grouped_mm [--threads 2]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import shardmoe.hf
from shardmoe.tools.bench.hf_model import DEFAULTS, FAMILY_DEFAULTS, SIZES, build_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="mixtral")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--candidate", choices=["shardmoe", "grouped_mm", "eager", "convert"], default="shardmoe")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"])
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = {**DEFAULTS, **FAMILY_DEFAULTS.get(args.family, {})}
    sizes = {name: settings[name] for name in SIZES}
    model = build_model(args.family, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype], **sizes)
    if args.candidate == "convert":
        model = shardmoe.hf.convert(model)
    else:
        model.set_experts_implementation(args.candidate)
    gen = torch.Generator().manual_seed(1)  # the bench's batches: its first is its checked step
    batches = [torch.randint(0, sizes["vocab"], (settings["batch"], sizes["seq_len"]), generator=gen)
               for _ in range(args.warmup + args.repeats + 1)]
    seconds = []
    for ids in batches[1:]:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        seconds.append(time.perf_counter() - start)
    print(f"model_alone: {args.family} {args.dtype} {args.candidate} threads={args.threads}: "
          f"{1e3 * statistics.median(seconds[args.warmup:]):.1f} ms median of {args.repeats} steps, peak resident "
          f"memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
