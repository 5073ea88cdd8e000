"""What sharing one model between candidates is worth on a whole model, apart from the code.

Candidates that switch one model's experts implementation between steps share its weights, while
`convert` runs a model of its own. This script keeps the seam and grouped_mm on one model (eager,
the slowest, is left out), `convert` on the converted model, and adds the seam on a deep copy of
its own ("seam-copy"): seam / seam-copy is what sharing the model is worth, and
convert / seam-copy is the difference of the code alone; that difference is why
`shardmoe bench --hf FAMILY --model` gives every candidate a copy of its own (docs/benchmarks.md,
"Whole models"). The candidates take turns in a random order each round (seeded), a step each;
the first round is not counted. Printed: median ms per step and median(grouped_mm) /
median(candidate) (above 1, the candidate is faster).

  python benchmarks/convert_gap.py --family mixtral --dtype bf16 --threads 2 [--rounds 30]
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

import shardmoe.hf
from shardmoe.tools.bench import hf_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="mixtral", choices=sorted(hf_model.FAMILIES))
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1:
        parser.error(f"expected --threads >= 1 and --rounds >= 1, got {args.threads} and {args.rounds}")
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sizes = hf_model.sizes_for(args.family, argparse.Namespace(quick=False))
    model = hf_model.build_model(args.family, dtype, **sizes)
    # copies before any forward: convert refuses a model with output hooks
    shared, twin = copy.deepcopy(model), copy.deepcopy(model)
    twin.set_experts_implementation("shardmoe")
    models = {"seam": shared, "grouped_mm": shared, "convert": shardmoe.hf.convert(model), "seam-copy": twin}
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq_len"]), generator=gen)
               for _ in range(args.rounds + 2)]
    cands = {name: hf_model.candidates({name: net}, batches)[name] for name, net in models.items()}
    implementation = {"seam": "shardmoe", "grouped_mm": "grouped_mm"}  # the shared model, switched per step
    names, order, times = list(cands), random.Random(0), {n: [] for n in cands}
    for r in range(args.rounds + 1):
        order.shuffle(names)
        for name in names:
            cands[name].reset()
            if name in implementation:
                shared.set_experts_implementation(implementation[name])
            start = time.perf_counter()
            cands[name].step()
            if r:
                times[name].append(time.perf_counter() - start)
    median = {n: statistics.median(t) for n, t in times.items()}
    print(f"{args.family} {args.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds in random order")
    for name, m in median.items():
        print(f"  {name:<11} {1e3 * m:8.1f} ms   grouped_mm / this {median['grouped_mm'] / m:5.3f}")
    print(f"  convert / seam-copy {median['convert'] / median['seam-copy']:5.3f}")


if __name__ == "__main__":
    main()
