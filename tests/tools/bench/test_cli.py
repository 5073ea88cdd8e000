"""The `shardmoe bench` subcommand (shardmoe.tools.bench): JSON, shape overrides, refusals, --mesh hand-over."""
from __future__ import annotations

import json
import os

import pytest
import torch

from shardmoe.tools import bench


def test_cli_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = bench.main(["--quick", "--tokens", "32", "--shapes", "e8", "--dtype", "fp32", "--repeats", "1",
                       "--candidates", "loop", "dense", "shardmoe", "--threads", "1", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "[e8 fp32]" in out and "columns: median ms" in out and "peak/tf: the step's peak" in out
    assert "targets" not in out and "bf16:" not in out  # the bars only with --strict; no bf16 case here
    data = json.loads(path.read_text())
    (case,) = data["cases"]
    assert case["shape"]["tokens"] == 32 and [r["candidate"] for r in case["rows"]] == ["loop", "dense", "shardmoe"]
    assert data["environment"]["threads"] >= 1


def test_cli_strict_prints_the_targets_and_bf16_is_explained(capfd):
    bench.main(["--quick", "--tokens", "32", "--shapes", "e8", "--dtype", "bf16", "--repeats", "1",
                "--candidates", "transformers", "shardmoe", "--threads", "1", "--strict"])
    captured = capfd.readouterr()
    assert "targets (shardmoe):" in captured.out and "bf16: shardmoe's rel err" in captured.out
    assert "allocated before the profiling started" not in captured.err  # the profiler's stray warning


def test_cli_shape_overrides(capsys):
    code = bench.main(["--shapes", "e64", "--tokens", "16", "--hidden", "32", "--ffn", "16", "--experts", "4",
                       "--top-k", "1", "--dtype", "fp32", "--repeats", "1", "--warmup", "1", "--threads", "1",
                       "--candidates", "loop", "dense"])
    assert code == 0
    assert "S=16 H=32 F=16 E=4 k=1" in capsys.readouterr().out


def test_cli_rejects_cuda_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert bench.main(["--device", "cuda"]) == 2


def test_mesh_runs_are_handed_to_the_distributed_bench(monkeypatch):
    from shardmoe.tools.bench import distributed as dist_bench

    seen = []
    monkeypatch.setattr(dist_bench, "run_distributed", lambda args: seen.append(args.mesh) or 0)
    assert bench.main(["--mesh", "e=1", "--quick"]) == 0
    assert seen == ["e=1"]


@pytest.mark.parametrize("threads", ["0", "100000"])
@pytest.mark.parametrize("mesh", [[], ["--mesh", "e=1"]])
def test_cli_bounds_threads_before_any_work(threads, mesh, capsys):
    """--threads had no upper bound (100000 segfaulted in torch.set_num_threads), and the --mesh
    hand-over, which shares the option, checked none."""
    before = torch.get_num_threads()
    assert bench.main(["--quick", "--threads", threads, *mesh]) == 2
    assert torch.get_num_threads() == before
    assert f"--threads: expected an int in 1..{os.cpu_count()} (os.cpu_count()), got {threads}" in \
        capsys.readouterr().err


@pytest.mark.parametrize("budget", ["nan", "inf", "0"])
def test_cli_refuses_a_budget_that_is_not_a_positive_finite_number(budget, capsys):
    """--budget nan passed a <= 0 check (and capped nothing)."""
    assert bench.main(["--quick", "--budget", budget]) == 2
    assert f"--budget a finite number > 0, got --repeats 3, --warmup 1, --tokens 512, --budget {float(budget)}" in \
        capsys.readouterr().err
