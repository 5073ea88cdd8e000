"""bf16 training (float32 masters under autocast) against float32: the default run twice.

Trains the `make run` job (the mixtral preset, 600 steps) with dtype = "float32" and with
dtype = "bfloat16", one after the other on the same seed and data, and prints the relative gap of
the training loss over step windows, the held-out losses, and the median tokens/s of each; draws
both curves into one PNG. --speed-only instead times one forward + backward of the default model
on its first batch in three precisions, interleaved: float32, float32 under bf16 autocast (what
dtype = "bfloat16" runs), and bf16 parameters (the alternative: bf16 weights beside float32
masters), printing each one's speed relative to float32.

  python benchmarks/bf16_training.py --out runs/bf16 [--steps 600] [--figure docs/training-bf16.png]
  python benchmarks/bf16_training.py --speed-only [--rounds 12]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import time

from shardmoe.model.transformer import Transformer
from shardmoe.train.config import TrainConfig
from shardmoe.train.loop import build_streams, train
from shardmoe.train.plots import plot_loss_comparison


def precision_speeds(rounds: int) -> dict[str, float]:
    """Median seconds of one forward + backward per precision (the first two rounds are warm-up)."""
    config = TrainConfig()
    batch = next(build_streams(config)[0])
    models = {"float32": Transformer(config.model, dtype=torch.float32),
              "bf16 parameters": Transformer(config.model, dtype=torch.bfloat16)}
    names = ("float32", "float32 under bf16 autocast", "bf16 parameters")
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for name in names:
            model = models["float32" if name.startswith("float32") else name]
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in name):
                losses = model(batch.ids, batch.is_seq_start, batch.targets)
            losses.total.backward()
            times[name].append(time.perf_counter() - started)
    return {n: statistics.median(t[2:]) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for the two runs")
    parser.add_argument("--speed-only", action="store_true", help="time the precisions, train nothing")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=TrainConfig().steps)
    parser.add_argument("--figure", default=None, help="PNG of both loss curves (default OUT/bf16.png)")
    args = parser.parse_args()
    torch.set_num_threads(TrainConfig().threads)
    if args.speed_only:
        speeds = precision_speeds(args.rounds)
        for name, seconds in speeds.items():
            print(f"{name}: {seconds * 1e3:.1f} ms, {speeds['float32'] / seconds:.2f}x float32's speed")
        return
    if args.out is None:
        parser.error("--out: expected a directory for the two runs (or --speed-only)")
    runs = {}
    for dtype in ("float32", "bfloat16"):
        config = TrainConfig.from_dict({"steps": args.steps, "dtype": dtype, "sample_tokens": 0})
        runs[dtype] = train(config, Path(args.out) / dtype, progress=False).metrics
    fp32, bf16 = runs["float32"], runs["bfloat16"]
    last = len(fp32)
    for lo, hi in ((1, last // 12), (last // 12 + 1, last // 2), (last // 2 + 1, last), (last - last // 12 + 1, last)):
        a = statistics.mean(r["loss"] for r in bf16[lo - 1:hi])
        b = statistics.mean(r["loss"] for r in fp32[lo - 1:hi])
        print(f"steps {lo:4d}-{hi:4d}: train loss bf16 {a:.4f}  fp32 {b:.4f}  ({(a - b) / b:+.2%})")
    for a, b in zip((r for r in bf16 if "val_loss" in r), (r for r in fp32 if "val_loss" in r)):
        print(f"step {a['step']:4d}: held-out bf16 {a['val_loss']:.4f}  fp32 {b['val_loss']:.4f}  "
              f"({(a['val_loss'] - b['val_loss']) / b['val_loss']:+.2%})")
    for name, rows in runs.items():
        print(f"{name}: median {statistics.median(r['tokens_per_s'] for r in rows):.0f} tokens/s")
    figure = plot_loss_comparison(runs, args.figure or Path(args.out) / "bf16.png",
                                  title=f"mixtral preset, {last} steps: float32 vs bf16 autocast (float32 masters)")
    print(f"figure: {figure}")


if __name__ == "__main__":
    main()
