"""Two failure behaviours that need a real world of ranks, checked in one spawned d=2 world:

- gradient health under a mesh: flags are judged on the full gradients (shards reduced), so a
  gradient planted on rank 1 alone reaches rank 0's metrics.jsonl, and a zero shard of a healthy
  gradient is not flagged;
- a hung peer: `shardmoe train --timeout-minutes` bounds how long the other rank waits.
"""
import contextlib
import io
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardmoe.mesh import Mesh
from shardmoe.model.transformer import Transformer
from shardmoe.testing.distributed import run_distributed

from .conftest import free_ports, tiny_train_config

TIMEOUT_MINUTES = 0.05  # 3 s


class Hung(Exception):
    """Raised in the hanging rank once the other rank has given up on it."""


def _plant_gradients(exploding: str, vanishing: str, zero_on_rank0: str):
    """Wrap Transformer.sync_grads: after the sync, rank 1's shard of `exploding` is scaled by 1e8,
    `vanishing` is zero on every rank, and only rank 0's shard of `zero_on_rank0` is zero."""
    original = Transformer.sync_grads

    def planted(self):
        original(self)
        params = dict(self.named_parameters())
        with torch.no_grad():
            if self.mesh.rank == 1:
                params[exploding].grad.mul_(1e8)
            params[vanishing].grad.zero_()
            if self.mesh.rank == 0:
                params[zero_on_rank0].grad.zero_()

    Transformer.sync_grads = planted
    return original


def _health_then_hang(tmp: str) -> dict:
    from shardmoe.cli import main
    from shardmoe.train import loop

    rank, out = dist.get_rank(), {}
    # -- gradient health under d=2 ---------------------------------------------------------------
    config = tiny_train_config(steps=2, health_every=1, eval_batches=0, sample_tokens=0)
    mesh = Mesh(dp=2)
    probe = Transformer(config.model, mesh=mesh)
    d_sharded = [n for n, spec in probe.specs.items() if "/d" in spec]
    exploding, zero_on_rank0, vanishing = d_sharded[0], d_sharded[1], "blocks.0.moe.gate_weight"
    original = _plant_gradients(exploding, vanishing, zero_on_rank0)
    try:
        loop.train(config, Path(tmp) / "health", mesh=mesh, progress=False)
    finally:
        Transformer.sync_grads = original
    if rank == 0:
        lines = (Path(tmp) / "health" / "metrics.jsonl").read_text().splitlines()
        out.update(flagged=[json.loads(line).get("flagged", []) for line in lines],
                   planted=(exploding, vanishing, zero_on_rank0))

    # -- a hung peer under `shardmoe train` ------------------------------------------------------
    port = free_ports(1)[0]
    dist.destroy_process_group()  # the command creates its own group, with its own timeout
    os.environ["MASTER_PORT"] = str(port)
    gave_up = Path(tmp) / "rank0-gave-up"
    if rank == 1:
        def hang(*args, **kwargs):  # stays away from every collective until rank 0 has given up
            deadline = time.monotonic() + 60
            while not gave_up.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise Hung

        loop.train = hang
    config_path = Path(tmp) / f"config{rank}.json"
    config_path.write_text(json.dumps(tiny_train_config(sample_tokens=0).to_dict()))
    argv = ["train", "--config", str(config_path), "--mesh", "d=2", "--out", str(Path(tmp) / "hang"),
            "--no-progress", "--timeout-minutes", str(TIMEOUT_MINUTES)]
    err = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stderr(err):
        try:
            out["code"] = main(argv)
        except Hung:
            out["code"] = "hung"
    out.update(seconds=time.monotonic() - started, stderr=err.getvalue())
    if rank == 0:
        gave_up.touch()
    return out


def test_health_flags_from_every_rank_and_a_hung_peer_times_out(tmp_path):
    rank0, rank1 = run_distributed(_health_then_hang, 2, args=(str(tmp_path),), timeout=90)

    exploding, vanishing, zero_on_rank0 = rank0["planted"]
    for flags in rank0["flagged"]:  # every step is a health step
        assert f"{exploding}: exploding" in flags  # planted on rank 1's shard only
        assert f"{vanishing}: vanishing" in flags
        assert not any(f.startswith(f"{zero_on_rank0}:") for f in flags)  # rank 1's shard is healthy

    assert rank1["code"] == "hung"
    assert rank0["code"] == 1
    assert rank0["stderr"].startswith("shardmoe train: rank 0: lost contact with the other ranks "
                                      f"(a peer hung or died; timeout_minutes={TIMEOUT_MINUTES:g})")
    assert rank0["stderr"].count("\n") == 1
    # the torch default would be 30 minutes; allow for start-up (model build, peak-FLOP probe)
    assert rank0["seconds"] < TIMEOUT_MINUTES * 60 + 20
