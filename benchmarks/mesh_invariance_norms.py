"""Per-step gradient norms of the mesh-invariance run on d=2 x e=2 against one process, in float64
and float32: how far a layout's training departs from one process's, and whether it is round-off.

    python benchmarks/mesh_invariance_norms.py

Trains tests/train's tiny config for 20 steps (eval and health off) with train(config, None) on one
process and on a spawned 4-rank gloo world with Mesh(dp=2, ep=2), one thread per process, and prints
per dtype the relative delta of each step's gradient norm and the largest.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from shardmoe.mesh import Mesh  # noqa: E402
from shardmoe.testing import run_distributed  # noqa: E402
from shardmoe.train.loop import train  # noqa: E402
from train.conftest import tiny_train_config  # noqa: E402

STEPS = 20


def _config(dtype: str):
    return tiny_train_config(steps=STEPS, eval_batches=0, health_every=0, dtype=dtype)


def _norms(dtype: str, mesh=None) -> list[float]:
    torch.set_num_threads(1)
    return [r["grad_norm"] for r in train(_config(dtype), None, mesh=mesh, progress=False).metrics]


def _on_mesh(dtype: str) -> list[float]:
    return _norms(dtype, Mesh(dp=2, ep=2))


def main() -> None:
    for dtype in ("float64", "float32"):
        one = _norms(dtype)
        mesh = run_distributed(_on_mesh, 4, args=(dtype,), timeout=600)[0]
        deltas = [abs(a - b) / b for a, b in zip(mesh, one)]
        worst = max(range(STEPS), key=deltas.__getitem__)
        print(f"{dtype}: largest relative delta {deltas[worst]:.1e} at step {worst + 1}; per step "
              + " ".join(f"{d:.1e}" for d in deltas))


if __name__ == "__main__":
    main()
