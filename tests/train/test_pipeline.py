"""Pipeline parallelism in training: a 'p' mesh axis on torch.distributed.pipelining.

One spawned world of 4 ranks trains a 4-block float64 model for 4 steps of 2 micro-batches
(balance_over = "global") on p=2 x e=2, p=2 x d=2 and p=2 x t=2 with each schedule (gpipe, 1f1b,
interleaved-1f1b with 2 stages per rank), and on p=4 with balance_over = "microbatch" and capacity
drops in every micro-batch (dropped_tokens sums them over the micro-batches); every step's
loss, aux loss, gradient norm and expert loads (and, in one run, the held-out loss, the health
flags and the samples) must equal the one-process run's (computed here) to float64 round-off. The same world resumes across pipeline
layouts: single-file checkpoints through train() (p=2 -> p=1, p=1 -> p=2) and sharded (DCP)
checkpoints through `shardmoe train --mesh p=2,e=2` (p=2 -> p=1, p=1 -> p=2), each continuing the
uninterrupted losses. A second world ends each failure with a message on every rank within the
timeout: ranks set up with another schedule, ranks given another --mesh, ranks given another lr
and --steps on a mesh without p, a stage that raises, a rank that dies.
"""
import contextlib
import dataclasses
import io
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardmoe.cli import main
from shardmoe.mesh import Mesh
from shardmoe.model.stages import StageModule
from shardmoe.testing import run_distributed
from shardmoe.testing.distributed import RankFailed
from shardmoe.train.checkpoint import latest_checkpoint
from shardmoe.train.loop import train

from .conftest import TINY_MODEL, all_ranks_at, free_ports, losses, single_threaded, tiny_train_config, with_moe

MODEL = dataclasses.replace(TINY_MODEL, n_layers=4)  # interleaved-1f1b on p=2 runs 4 stages of one block
# capacity ceil(64 tokens / 4 experts * 0.5 * top-2) = 16 of each micro-batch's 128 pairs per expert: drops in each
DROPPING = with_moe(MODEL, capacity_factor=0.5)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))
LAYOUTS = {"p=2,e=2": dict(pp=2, ep=2), "p=2,d=2": dict(pp=2, dp=2), "p=2,t=2": dict(pp=2, tp=2)}
COLUMNS = ("loss", "aux_loss", "grad_norm", "val_loss")
FLOAT64 = 1e-12  # relative; measured at most 2.8e-16 (docs/parallel.md, "Pipeline parallelism")


def config(**changes):
    settings = dict(model=MODEL, dtype="float64", steps=4, batch_size=8, grad_accum_steps=2, balance_over="global",
                    eval_batches=0, sample_tokens=0, health_every=0, checkpoint_every=0)
    return tiny_train_config(**{**settings, **changes})


# evaluation, samples and the gradient health report, through the stages (in one run of each kind)
EXTRAS = dict(eval_every=0, eval_batches=1, sample_tokens=3, health_every=2)


def rows(metrics):
    return [{k: r[k] for k in COLUMNS + ("expert_tokens", "dropped_tokens", "flagged") if k in r} for r in metrics]


def cli_config(tmp: Path, name: str, **changes) -> str:
    """config(**changes) as a file of this process's own (ranks writing one file race)."""
    path = tmp / f"{name}-{os.environ.get('RANK', 'parent')}.json"
    path.write_text(json.dumps(config(**changes).to_dict()))
    return str(path)


def _training_world(tmp: str) -> dict:
    from shardmoe.train import loop
    from shardmoe.train.flops import Peak

    tmp = Path(tmp)
    torch.set_num_threads(1)
    # only the MFU column reads it; ten 1024^2 matmuls per run saved
    loop.peak_flops = lambda device, dtype: Peak(1e9, "a stand-in peak")
    out = {}
    for name, layout in LAYOUTS.items():
        for schedule, per_rank in SCHEDULES:
            extras = EXTRAS if (name, schedule) == ("p=2,e=2", "1f1b") else {}
            run = train(config(pipeline_schedule=schedule, stages_per_rank=per_rank, **extras), None,
                        mesh=Mesh(**layout), progress=False)
            out[(name, schedule)] = (rows(run.metrics), run.samples)
    run = train(config(balance_over="microbatch", pipeline_schedule="gpipe", model=DROPPING), None, mesh=Mesh(pp=4),
                progress=False)
    out[("p=4", "gpipe")] = (rows(run.metrics), run.samples)
    # single-file checkpoints, through the API: written at p=2 (rank 0 gathers every stage), read at p=2
    p2e2 = Mesh(pp=2, ep=2)
    train(config(checkpoint_format="safetensors"), tmp / "file-p2-p1", mesh=p2e2, stop_after=2, progress=False)
    resumed = train(config(checkpoint_format="safetensors"), tmp / "file-p1-p2", mesh=p2e2, resume=True,
                    progress=False)
    out["file p1 -> p2"] = [r["loss"] for r in resumed.new_metrics]
    # sharded checkpoints, through the command on process groups of its own
    ports = free_ports(2)
    dist.destroy_process_group()
    common = ["--mesh", "p=2,e=2", "--no-progress"]
    all_ranks_at(tmp, "cli-resume")
    os.environ["MASTER_PORT"] = str(ports[0])
    out["cli p1 -> p2"] = main(["train", "--config", cli_config(tmp, "dcp", checkpoint_format="dcp"),
                                "--out", str(tmp / "dcp-p1-p2"), "--resume", "--steps", "4"] + common)
    all_ranks_at(tmp, "cli-run")
    os.environ["MASTER_PORT"] = str(ports[1])
    out["cli p2"] = main(["train", "--config", cli_config(tmp, "auto"), "--out", str(tmp / "dcp-p2-p1"),
                          "--steps", "2"] + common)
    return out


@pytest.fixture(scope="module")
def golden():
    with single_threaded():
        whole = train(config(**EXTRAS), None, progress=False)
        microbatch = train(config(balance_over="microbatch", model=DROPPING), None, progress=False)
    return {"global": (rows(whole.metrics), whole.samples), "microbatch": (rows(microbatch.metrics),
                                                                          microbatch.samples)}


def assert_equal_run(mine, gold, where):
    """Every step's columns equal to float64 round-off, the loads exactly; the held-out loss, the
    health flags and the samples wherever the run has them."""
    (my_rows, my_samples), (gold_rows, gold_samples) = mine, gold
    assert len(my_rows) == len(gold_rows) == 4, where
    for step, (a, b) in enumerate(zip(my_rows, gold_rows), start=1):
        for key in COLUMNS:
            if key in a:
                assert abs(a[key] - b[key]) <= FLOAT64 * abs(b[key]), (where, step, key, a[key], b[key])
        assert a["expert_tokens"] == b["expert_tokens"] and a["dropped_tokens"] == b["dropped_tokens"], (where, step)
        assert a.get("flagged") == b.get("flagged"), (where, step)
    if my_samples:
        assert my_samples == gold_samples, where


def test_pipelined_training_equals_one_process_and_resumes_across_layouts(golden, tmp_path, one_thread,
                                                                         monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # what the world resumes: one-process runs stopped at step 2, in each format
    train(config(checkpoint_format="safetensors"), tmp_path / "file-p1-p2", stop_after=2, progress=False)
    assert main(["train", "--config", cli_config(tmp_path, "dcp", checkpoint_format="dcp"), "--out",
                 str(tmp_path / "dcp-p1-p2"), "--steps", "2", "--no-progress"]) == 0

    ranks = run_distributed(_training_world, 4, args=(str(tmp_path),), timeout=420)

    for out in ranks:
        assert out["cli p1 -> p2"] == out["cli p2"] == 0, out
    rank0 = ranks[0]
    assert "val_loss" in rank0[("p=2,e=2", "1f1b")][0][-1] and len(rank0[("p=2,e=2", "1f1b")][1]) == 3
    for layout in LAYOUTS:
        for schedule, _ in SCHEDULES:
            for out in ranks:  # every rank holds the same rows
                assert_equal_run(out[(layout, schedule)], golden["global"], (layout, schedule))
    assert all(r["dropped_tokens"] > 0 for r in golden["microbatch"][0])
    assert_equal_run(rank0[("p=4", "gpipe")], golden["microbatch"], "p=4")

    gold = [r["loss"] for r in golden["global"][0]][2:]
    assert rank0["file p1 -> p2"] == pytest.approx(gold, rel=FLOAT64, abs=0)
    resumed = train(config(checkpoint_format="safetensors"), tmp_path / "file-p2-p1", resume=True, progress=False)
    assert [r["loss"] for r in resumed.new_metrics] == pytest.approx(gold, rel=FLOAT64, abs=0)
    assert losses(tmp_path / "dcp-p1-p2", (3, 4)) == pytest.approx(gold, rel=FLOAT64, abs=0)
    # the p=2 run's last step wrote the sharded checkpoint and the single-file export; a resume takes the sharded one
    assert latest_checkpoint(tmp_path / "dcp-p2-p1") == tmp_path / "dcp-p2-p1" / "checkpoint.dcp" / "step_000002"
    assert main(["train", "--config", cli_config(tmp_path, "auto"), "--out", str(tmp_path / "dcp-p2-p1"), "--resume",
                 "--steps", "4", "--no-progress"]) == 0
    assert losses(tmp_path / "dcp-p2-p1", (3, 4)) == pytest.approx(gold, rel=FLOAT64, abs=0)


# -- failures --------------------------------------------------------------------------------

TIMEOUT_MINUTES = 0.05  # 3 s


def _command(tmp: Path, name: str, port: int, mesh: str = "p=2,e=2", **changes) -> dict:
    """`shardmoe train` on a process group of its own: its exit code (or the error it raised), its
    stderr, and the time it ended."""
    all_ranks_at(tmp, name)
    os.environ["MASTER_PORT"] = str(port)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["train", "--config", cli_config(tmp, name, dtype="float32", eval_batches=0, sample_tokens=0,
                                                         health_every=0, **changes),
                         "--out", str(tmp / name), "--mesh", mesh, "--no-progress",
                         "--timeout-minutes", str(TIMEOUT_MINUTES)])
        except Exception as error:
            code = f"{type(error).__name__}: {error}"
    return {"code": code, "stderr": err.getvalue(), "ended": time.time()}


def _planted(tmp: Path, event: str, action):
    """StageModule.forward that runs `action` at its third call (the second step's first forward),
    writing the time to tmp/event first."""
    forward, calls = StageModule.forward, [0]

    def planted(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            (tmp / event).write_text(str(time.time()))
            action()
        return forward(self, *args, **kwargs)

    return planted


def _failures_world(tmp: str) -> dict:
    tmp = Path(tmp)
    rank = dist.get_rank()
    ports = free_ports(5)
    dist.destroy_process_group()
    out = {"schedule": _command(tmp, "schedule", ports[0], pipeline_schedule="gpipe" if rank >= 2 else "1f1b"),
           "mesh": _command(tmp, "mesh", ports[1], mesh="p=2,e=2" if rank >= 2 else "p=2,d=2"),
           "settings": _command(tmp, "settings", ports[4], mesh="d=2,e=2", lr=0.02 if rank >= 2 else 0.01,
                                steps=6 if rank >= 2 else 4)}
    forward = StageModule.forward

    def raise_error():
        raise ValueError("planted: stage 1 raises")

    if rank >= 2:  # every rank of stage 1
        StageModule.forward = _planted(tmp, "raised", raise_error)
    out["raises"] = _command(tmp, "raises", ports[2])
    StageModule.forward = forward
    if rank == 3:
        StageModule.forward = _planted(tmp, "died", lambda: os._exit(3))
    out["dies"] = _command(tmp, "dies", ports[3])
    return out


def test_failures_end_with_a_message_on_every_rank_within_the_timeout(tmp_path):
    with pytest.raises(RankFailed) as caught:  # rank 3 dies
        run_distributed(_failures_world, 4, args=(str(tmp_path),), timeout=240, report_grace=60)
    assert caught.value.rank == 3 and "exited with code 3" in caught.value.details
    ranks = caught.value.results
    assert sorted(ranks) == [0, 1, 2], caught.value
    timeout = TIMEOUT_MINUTES * 60
    raised, died = (float((tmp_path / name).read_text()) for name in ("raised", "died"))
    for rank, out in ranks.items():
        agreement = f"shardmoe train: rank {rank}: the run's settings differ across ranks (every rank must be given " \
            "the same config file and flags): "
        schedule = out["schedule"]
        assert schedule["code"] == 2 and schedule["stderr"] == (
            f"{agreement}pipeline_schedule: ranks 0, 1 have '1f1b', ranks 2, 3 have 'gpipe'\n")
        # a mesh without p: the ranks' lr drifted the replicas apart, their steps ended in a timeout
        settings = out["settings"]
        assert settings["code"] == 2 and settings["stderr"] == (
            f"{agreement}lr: ranks 0, 1 have 0.01, ranks 2, 3 have 0.02; steps: ranks 0, 1 have 4, ranks 2, 3 have 6\n")
        mesh = out["mesh"]
        assert mesh["code"] == 2 and mesh["stderr"].startswith(agreement) and \
            "--mesh: ranks 0, 1 have {'p': 2, 'd': 2, 'e': 1, 't': 1}, ranks 2, 3 have {'p': 2, 'd': 1, 'e': 2, " \
            "'t': 1}" in mesh["stderr"], mesh
        raises = out["raises"]
        if rank >= 2:  # the stage's own error, as itself
            assert raises["code"] == "ValueError: planted: stage 1 raises", raises
        else:  # stage 0 waited on it
            assert raises["code"] == 1 and raises["stderr"].startswith(
                f"shardmoe train: rank {rank}: lost contact with the other ranks (a peer hung or died; "
                f"timeout_minutes={TIMEOUT_MINUTES:g}): pipeline stage 0 waited on a rank that failed, hung or left: "), \
                raises
            assert raises["stderr"].count("\n") == 1
        assert raises["ended"] - raised < timeout + 2, (rank, raises["ended"] - raised)
        dies = out["dies"]
        assert dies["code"] == 1 and dies["stderr"].startswith(f"shardmoe train: rank {rank}: lost contact with the "
                                                              "other ranks"), dies
        assert dies["ended"] - died < timeout + 2, (rank, dies["ended"] - died)
