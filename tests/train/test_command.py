"""`shardmoe train` end to end on a tiny config, and bad input stopping before any process group."""
import json

import pytest
import torch.distributed as dist

from shardmoe.cli import main

from .conftest import tiny_train_config


def write_config(tmp_path, **changes):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_train_config(**changes).to_dict()))
    return str(path)


def test_tiny_run_writes_metrics_curve_checkpoint_and_samples(tmp_path, capsys, one_thread):
    out = tmp_path / "run"
    assert main(["train", "--config", write_config(tmp_path), "--steps", "3", "--seed", "2",
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all("loss" in r for r in rows)
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoint.safetensors").is_file()
    samples = printed.split("samples:\n")[1].splitlines()
    assert len(samples) == 3 and samples[0].startswith("  In the beginning")
    assert "tokens/s" in printed and "MFU" in printed

    assert main(["train", "--config", write_config(tmp_path), "--steps", "3", "--seed", "2", "--out", str(out),
                 "--resume", "--no-progress"]) == 0
    assert "nothing to train" in capsys.readouterr().out


@pytest.mark.parametrize("changes, mesh, message", [
    ({}, "t=4", "n_kv_heads: expected a multiple of 4"),
    ({}, "e=3", "num_experts: expected a multiple of 3"),
    ({"model": {"vocab_size": 257}}, "t=2", "vocab_size: expected a multiple of 2"),
    ({"corpus": "/nonexistent/corpus.txt"}, "", "corpus: no such file"),
    ({"batch_size": 6}, "d=4", "batch_size: expected a multiple of d*e = 4"),
    ({}, "d=2,e=2", "needs 4 rank(s), but the world size is 1"),
    ({}, "x=2", "--mesh: expected"),
])
def test_bad_input_stops_with_one_message_before_any_process_group(tmp_path, capsys, changes, mesh, message):
    config = tiny_train_config().to_dict()
    for key, value in changes.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    assert main(["train", "--config", str(path), "--mesh", mesh, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardmoe train: ") and message in err and err.count("\n") == 1
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()


def test_resume_refuses_a_checkpoint_of_another_config(tmp_path, capsys, one_thread):
    out = str(tmp_path / "run")
    assert main(["train", "--config", write_config(tmp_path, sample_bytes=0), "--steps", "1", "--out", out,
                 "--no-progress"]) == 0
    capsys.readouterr()
    other = tiny_train_config().to_dict()
    other["model"]["n_layers"] = 3
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    assert main(["train", "--config", str(path), "--out", out, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "another config" in err and "model.n_layers: saved 2, now 3" in err and err.count("\n") == 1
