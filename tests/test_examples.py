"""The runnable examples under examples/ run as documented: the FSDP2 + expert parallelism + DCP
recipe (docs/parallel.md) on 4 local gloo processes, and under torchrun, which gives every rank one
checkpoint directory and refuses another world size up front."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardmoe
from shardmoe.testing import run_distributed

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # run_distributed's ranks find a function's module by its file
    spec.loader.exec_module(module)
    return module


def test_fsdp_expert_parallel_recipe_trains_and_reloads_exactly(tmp_path):
    example = _load("fsdp_expert_parallel")
    results = run_distributed(example.train, 4, args=(30, str(tmp_path / "checkpoint")), timeout=300)
    losses = results[0]["losses"]
    assert all(r["losses"] == losses for r in results)  # global means, the same on every rank
    assert len(losses) == 30 and losses[-1] < 0.9 * losses[0], losses
    assert all(r["reload_difference"] == 0.0 for r in results)


def test_the_recipe_under_torchrun_on_gloo_shares_one_checkpoint_directory():
    """As docs/parallel.md launches it, with the default (temporary) checkpoint directory: each rank
    made its own, and rank 1..3's reload found no .metadata (FileNotFoundError, then SIGABRT)."""
    env = {**os.environ, "PYTHONPATH": str(Path(shardmoe.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(EXAMPLES / "fsdp_expert_parallel.py"), "--steps", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the reloaded model's output differs by 0.0e+00" in done.stdout, done.stdout


def test_the_recipe_refuses_another_world_size_before_any_process_group(monkeypatch, capsys):
    """With 2 ranks it failed inside torch ("Mesh should not be bigger than default world size")."""
    example = _load("fsdp_expert_parallel")
    monkeypatch.setattr(sys, "argv", ["fsdp_expert_parallel.py"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        example.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("fsdp_expert_parallel.py: expected 4 ranks (a 2 x 2 job mesh of dp and ep), "
                                       "got WORLD_SIZE=2: launch with torchrun --nproc-per-node 4\n")
