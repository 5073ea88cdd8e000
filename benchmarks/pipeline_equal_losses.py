"""Pipelined training against one process: the largest relative delta of each layout and schedule.

    python benchmarks/pipeline_equal_losses.py

Trains tests/train/test_pipeline.py's config (4 blocks, float64, 4 steps of 2 micro-batches,
balance_over = "global") with train(config, None) on one process and, in one spawned 4-rank gloo
world, on p=2 x e=2, p=2 x d=2 and p=2 x t=2 with gpipe, 1f1b and interleaved-1f1b (2 stages per
rank); prints per layout and schedule the largest relative delta of the loss, the aux loss and the
gradient norm over the steps, and whether every step's expert loads are equal.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from shardmoe.mesh import Mesh  # noqa: E402
from shardmoe.testing import run_distributed  # noqa: E402
from shardmoe.train.loop import train  # noqa: E402
from train.test_pipeline import LAYOUTS, SCHEDULES, config  # noqa: E402

COLUMNS = ("loss", "aux_loss", "grad_norm")


def _rows(metrics):
    return [{k: r[k] for k in COLUMNS + ("expert_tokens",)} for r in metrics]


def _world() -> dict:
    torch.set_num_threads(1)
    return {(name, schedule): _rows(train(config(pipeline_schedule=schedule, stages_per_rank=per_rank), None,
                                          mesh=Mesh(**layout), progress=False).metrics)
            for name, layout in LAYOUTS.items() for schedule, per_rank in SCHEDULES}


def main() -> None:
    torch.set_num_threads(1)
    gold = _rows(train(config(), None, progress=False).metrics)
    runs = run_distributed(_world, 4, timeout=900)[0]
    print(f"{'layout':>8} {'schedule':>16} {'loss':>8} {'aux loss':>8} {'grad norm':>9} loads")
    for (name, schedule), rows in runs.items():
        deltas = [max(abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(rows, gold)) for k in COLUMNS]
        loads = all(a["expert_tokens"] == b["expert_tokens"] for a, b in zip(rows, gold))
        print(f"{name:>8} {schedule:>16} " + " ".join(f"{d:>8.1e}" for d in deltas) + f"  {'equal' if loads else 'DIFFER'}")


if __name__ == "__main__":
    main()
