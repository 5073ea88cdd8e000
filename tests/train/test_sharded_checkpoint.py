"""Sharded (torch.distributed.checkpoint) checkpoints of the training run, in one spawned world of 4.

- the model's state_dict() holds whole logical tensors: on d=2 x t=2 (norm gains cut over t, then
  d) and d=2 x e=2 every entry's full_tensor() is the one-process full state dict, bit for bit;
  a dcp.save at d=2 x t=2 loads exactly at d=2 x e=2 and into one process;
- train() on d=2 x e=2 interrupted at step 3 writes checkpoint.dcp/ (no single file) and resumes
  on the same layout to the uninterrupted run's losses bitwise;
- `shardmoe train --mesh d=2,e=2` on 4 ranks writes a sharded checkpoint that a one-process
  `--resume` reads (the tie with the last step's single-file export goes to the sharded one):
  its losses continue within 1e-6 of the 4-rank continuation; and the reverse, a one-process run
  with checkpoint_format "dcp" resumed on 4 ranks;
- what rank 0 alone finds wrong (a corrupt shard at resume, a failed clearing at save) is raised on
  every rank; a corrupt file of the sharded checkpoint is named before any weight is loaded, and --overwrite
  deletes the sharded directory.
"""
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardmoe.cli import main
from shardmoe.mesh import Mesh
from shardmoe.model.transformer import Transformer
from shardmoe.testing import run_distributed
from shardmoe.train import checkpoint as ckpt
from shardmoe.train import sharded_checkpoint
from shardmoe.train.loop import train

from .conftest import TINY_MODEL, all_ranks_at, free_ports, losses, tiny_train_config

STEPS, MORE = 6, 8


def cli_config(tmp: Path, **changes) -> str:
    """The tiny config as a file of its own per rank (ranks writing one file race)."""
    path = tmp / f"config-{os.environ.get('RANK', 'parent')}-{'-'.join(f'{k}{v}' for k, v in changes.items()) or 'default'}.json"
    path.write_text(json.dumps(tiny_train_config(steps=STEPS, checkpoint_every=3, eval_batches=0, sample_tokens=0,
                                                 health_every=0, **changes).to_dict()))
    return str(path)


def _state_dict_checks(tmp: str) -> dict:
    """Whole tensors from d2 x t2 and d2 x e2; a dcp.save at d2 x t2 loaded at d2 x e2 and on one process."""
    import torch.distributed.checkpoint as dcp

    results = {}
    expected = Transformer(TINY_MODEL, seed=5).full_state_dict()
    for layout in ((2, 1, 2), (2, 2, 1)):
        model = Transformer(TINY_MODEL, mesh=Mesh(*layout), seed=5)
        state = model.state_dict()
        results[f"whole {layout}"] = sorted(
            name for name, value in state.items() if name in expected and not torch.equal(
                value.full_tensor() if hasattr(value, "full_tensor") else value,
                expected[name].view(value.shape)))
    saved = Transformer(TINY_MODEL, mesh=Mesh(2, 1, 2), seed=5)
    dcp.save(saved.state_dict(), checkpoint_id=f"{tmp}/d2t2")
    loaded = Transformer(TINY_MODEL, mesh=Mesh(2, 2, 1), seed=6)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=f"{tmp}/d2t2")
    loaded.load_state_dict(state)
    results["d2t2 -> d2e2"] = sorted(n for n, t in loaded.full_state_dict().items() if not torch.equal(t, expected[n]))
    if dist.get_rank() == 0:  # one process: plain whole tensors, no process group used
        single = Transformer(TINY_MODEL, seed=6)
        state = single.state_dict()
        dcp.load(state, checkpoint_id=f"{tmp}/d2t2", no_dist=True)
        single.load_state_dict(state)
        results["d2t2 -> 1"] = sorted(n for n, t in single.full_state_dict().items() if not torch.equal(t, expected[n]))
    return results


def _rank0_failures_on_every_rank(tmp: Path, config, mesh) -> dict:
    """What rank 0 alone finds wrong is raised on every rank: a corrupt shard file at resume (its
    sha256 check) and a failed clearing of the step directory at save (a file in its place)."""
    if dist.get_rank() == 0:
        shutil.copytree(tmp / "api", tmp / "corrupt")
        shard = next(sharded_checkpoint.latest(tmp / "corrupt").glob("__1_*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
        (tmp / "blocked" / "checkpoint.dcp").mkdir(parents=True)
        (tmp / "blocked" / "checkpoint.dcp" / "step_000003").write_text("not a directory")
    dist.barrier()
    raised = {}
    for name, run in (("corrupt resume", lambda: train(config, tmp / "corrupt", mesh=mesh, resume=True, progress=False)),
                      ("blocked save", lambda: train(config, tmp / "blocked", mesh=mesh, stop_after=3, progress=False))):
        try:
            run()
            raised[name] = None
        except Exception as err:
            raised[name] = (type(err).__name__, str(err))
    return raised


def _world(tmp: str) -> dict:
    tmp = Path(tmp)
    torch.set_num_threads(1)
    out = _state_dict_checks(str(tmp))
    mesh = Mesh(dp=2, ep=2)
    config = tiny_train_config(steps=STEPS, eval_batches=0, sample_tokens=0, health_every=0)
    whole = train(config, None, mesh=mesh, progress=False)
    train(config, tmp / "api", mesh=mesh, stop_after=3, progress=False)
    out["files after the interruption"] = sorted(p.name for p in (tmp / "api").iterdir())
    out["step directories"] = sorted(p.name for p in (tmp / "api" / "checkpoint.dcp").iterdir())
    resumed = train(config, tmp / "api", mesh=mesh, resume=True, progress=False)
    out["resume bitwise"] = [r["loss"] for r in resumed.metrics] == [r["loss"] for r in whole.metrics]
    out.update(_rank0_failures_on_every_rank(tmp, config, mesh))

    # the command line, on fresh process groups of its own
    ports = free_ports(3)
    dist.destroy_process_group()
    common = ["--mesh", "d=2,e=2", "--no-progress"]
    os.environ["MASTER_PORT"] = str(ports[0])
    out["cli run"] = main(["train", "--config", cli_config(tmp), "--out", str(tmp / "four")] + common)
    if int(os.environ["RANK"]) == 0:
        shutil.copytree(tmp / "four", tmp / "four-then-one")
    all_ranks_at(tmp, "run")
    os.environ["MASTER_PORT"] = str(ports[1])
    out["cli resume"] = main(["train", "--config", cli_config(tmp), "--out", str(tmp / "four"), "--resume",
                              "--steps", str(MORE)] + common)
    all_ranks_at(tmp, "resume")
    os.environ["MASTER_PORT"] = str(ports[2])
    out["cli resume of one process's run"] = main(
        ["train", "--config", cli_config(tmp, checkpoint_format="dcp"), "--out", str(tmp / "one-then-four"),
         "--resume", "--steps", str(MORE)] + common)
    return out


@pytest.fixture
def one_process_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_sharded_checkpoints_resume_across_layouts(tmp_path, one_thread, one_process_env, capsys):
    # a one-process run writing sharded checkpoints, resumed by the world below and here
    one = ["--config", cli_config(tmp_path, checkpoint_format="dcp"), "--no-progress"]
    assert main(["train", *one, "--out", str(tmp_path / "one")]) == 0
    assert (tmp_path / "one" / "checkpoint.dcp" / "step_000006" / "shardmoe.json").is_file()
    shutil.copytree(tmp_path / "one", tmp_path / "one-then-four")

    ranks = run_distributed(_world, 4, args=(str(tmp_path),), timeout=300)
    rank0 = ranks[0]
    for out in ranks:  # every rank's command succeeded, and every rank resumed bitwise
        assert out["cli run"] == out["cli resume"] == out["cli resume of one process's run"] == 0, out
        assert out["resume bitwise"]
        # rank 0's verdicts reached every rank (a rank that missed one would have run on, or hung)
        kind, message = out["corrupt resume"]
        assert kind == "ValueError" and "corrupt: file '__1_" in message, out["corrupt resume"]
        kind, message = out["blocked save"]
        assert kind == "OSError" and message.startswith("sharded checkpoint: ") and "step_000003" in message, \
            out["blocked save"]

    assert rank0["whole (2, 1, 2)"] == [] and rank0["whole (2, 2, 1)"] == []
    assert rank0["d2t2 -> d2e2"] == [] and rank0["d2t2 -> 1"] == []
    assert rank0["files after the interruption"] == ["checkpoint.dcp", "metrics.jsonl"]
    assert rank0["step directories"] == ["LATEST", "step_000003"]
    assert rank0["resume bitwise"]
    assert rank0["cli run"] == rank0["cli resume"] == rank0["cli resume of one process's run"] == 0

    # 4 ranks -> one process: the sharded checkpoint at step 6 (tied with the export) is the one read
    four_then_one = tmp_path / "four-then-one"
    assert ckpt.latest_checkpoint(four_then_one) == four_then_one / "checkpoint.dcp" / "step_000006"
    assert main(["train", "--config", cli_config(tmp_path), "--out", str(four_then_one), "--resume",
                 "--steps", str(MORE), "--no-progress"]) == 0
    continued = range(STEPS + 1, MORE + 1)
    for mine, theirs in zip(losses(four_then_one, continued), losses(tmp_path / "four", continued), strict=True):
        assert abs(mine - theirs) <= 1e-6 * abs(theirs), (mine, theirs)

    # one process -> 4 ranks
    assert main(["train", *one, "--out", str(tmp_path / "one"), "--resume", "--steps", str(MORE)]) == 0
    for mine, theirs in zip(losses(tmp_path / "one-then-four", continued), losses(tmp_path / "one", continued),
                            strict=True):
        assert abs(mine - theirs) <= 1e-6 * abs(theirs), (mine, theirs)

    # a flipped byte in a shard file is named before anything loads; --overwrite clears the directory
    step_dir = sharded_checkpoint.latest(tmp_path / "one")
    shard = next(p for p in step_dir.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    (tmp_path / "one" / "checkpoint.safetensors").unlink()
    capsys.readouterr()
    assert main(["train", *one, "--out", str(tmp_path / "one"), "--resume", "--steps", str(MORE + 1)]) == 2
    assert f"corrupt: file {shard.name!r} has sha256" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"corrupt: file {shard.name!r} has sha256"):  # through the API too
        train(tiny_train_config(steps=MORE + 1, checkpoint_every=3, eval_batches=0, sample_tokens=0, health_every=0,
                                checkpoint_format="dcp"), tmp_path / "one", resume=True, progress=False)
    # --overwrite clears checkpoint.dcp/ itself: the new run (one process, format auto) writes only the
    # single file, so none of the directory can have been replaced by a sharded save's own cleanup
    plain = ["--config", cli_config(tmp_path), "--no-progress"]
    assert main(["train", *plain, "--out", str(tmp_path / "one"), "--overwrite", "--steps", "1"]) == 0
    assert not (tmp_path / "one" / "checkpoint.dcp").exists()
    assert (tmp_path / "one" / "checkpoint.safetensors").exists()


def test_a_latest_pointer_to_a_missing_directory_is_named(tmp_path):
    root = tmp_path / "checkpoint.dcp"
    root.mkdir()
    (root / "LATEST").write_text("step_000006")
    with pytest.raises(ValueError, match=r"LATEST: names step_000006, which is not a directory of .*checkpoint\.dcp"):
        ckpt.latest_checkpoint(tmp_path)


def test_a_failed_dcp_write_is_reported_by_its_cause(tmp_path):
    """DCP's CheckpointException reads "CheckpointException ranks:dict_keys([0])" on its first line;
    the command reports each failed rank's own error instead (a directory where a shard file goes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from shardmoe.train.command import checkpoint_failure

    (tmp_path / "__0_0.distcp").mkdir()
    with pytest.raises(CheckpointException) as caught, sharded_checkpoint._one_process_is_intended():
        dcp.save({"w": torch.zeros(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert checkpoint_failure(caught.value) == (f"sharded checkpoint: rank 0: IsADirectoryError: [Errno 21] Is a "
                                                f"directory: '{tmp_path / '__0_0.distcp'}'")


def test_a_failed_write_of_rank_0_is_raised_as_an_os_error(tmp_path, one_thread):
    """Rank 0's own part (here: clearing a step directory that is a file) raises OSError, which the
    command reports in one line; under a mesh every rank raises it (the world above checks that)."""
    config = tiny_train_config(steps=3, checkpoint_every=0, eval_batches=0, sample_tokens=0, health_every=0,
                               checkpoint_format="dcp")
    (tmp_path / "checkpoint.dcp").mkdir()
    (tmp_path / "checkpoint.dcp" / "step_000003").write_text("not a directory")
    with pytest.raises(OSError, match="sharded checkpoint: .*step_000003"):
        train(config, tmp_path, progress=False)


def test_step_directories_without_latest_are_refused_by_name_and_a_resume_says_what_it_resumes(tmp_path, capsys,
                                                                                               one_thread):
    """Without LATEST the resume fell back to checkpoint.safetensors without a word, though it is
    older here (step 1 against the sharded step 3)."""
    config = tiny_train_config(steps=4, checkpoint_every=1, eval_batches=0, sample_tokens=0, health_every=0)
    run = tmp_path / "run"
    train(config.replace(checkpoint_format="dcp"), run, stop_after=3, progress=False)
    train(config, tmp_path / "older", stop_after=1, progress=False)
    shutil.copy(tmp_path / "older" / "checkpoint.safetensors", run)
    step_dir = run / "checkpoint.dcp" / "step_000003"
    assert ckpt.latest_checkpoint(run) == step_dir
    (run / "checkpoint.dcp" / "LATEST").unlink()

    message = (f"checkpoint {run / 'checkpoint.dcp'}: holds step_000003 but no LATEST naming the complete one; write "
               f"the name of a complete step directory (with shardmoe.json) into {run / 'checkpoint.dcp' / 'LATEST'}, "
               f"or remove the step directories to resume from what else {run} holds")
    with pytest.raises(ValueError, match=re.escape(message)):
        ckpt.latest_checkpoint(run)
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"shardmoe train: --resume: {message}\n"

    (run / "checkpoint.dcp" / "LATEST").write_text("step_000003")
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert f"resuming {run} from {step_dir} at step 3 of 4\n" in capsys.readouterr().out
