"""metrics.jsonl: a failed append leaves no torn row; a torn final row does not block --resume."""
import errno
import json
import os

import pytest

from shardmoe.cli import main
from shardmoe.train import metrics
from shardmoe.train.loop import train
from shardmoe.train.metrics import METRICS_FILE, read_metrics

from .conftest import tiny_train_config


def steps_in(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_disk_full_mid_row_leaves_whole_rows_and_the_run_resumes(tmp_path, capsys, monkeypatch, one_thread):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_train_config(steps=4, checkpoint_every=2, sample_tokens=0).to_dict()))
    out = tmp_path / "run"
    real_write = os.write

    def disk_fills_at_step_3(fd, data):
        if b'"step": 3,' in data:  # half the row reaches the disk, then it is full
            real_write(fd, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(metrics.os, "write", disk_fills_at_step_3)
    argv = ["train", "--config", str(config), "--out", str(out), "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"shardmoe train: rank 0: [Errno {errno.ENOSPC}] cannot append step 3 to {out / METRICS_FILE}: "
                   "No space left on device; the file keeps its earlier rows\n")
    assert steps_in(out / METRICS_FILE) == [1, 2]  # no torn third line

    monkeypatch.setattr(metrics.os, "write", real_write)
    assert main(argv + ["--resume"]) == 0
    assert steps_in(out / METRICS_FILE) == [1, 2, 3, 4]


def test_a_torn_final_row_is_dropped_on_resume_naming_the_file(tmp_path, tiny_config, one_thread):
    config = tiny_config(steps=3, checkpoint_every=2, eval_batches=0)
    train(config, tmp_path, stop_after=2, progress=False)
    path = tmp_path / METRICS_FILE
    with open(path, "a") as f:  # killed mid-append: part of a row, no newline
        f.write('{"step": 3, "loss": 5.')
    with pytest.warns(UserWarning, match=rf"{path}: dropping a torn final row \(line 3, 22 bytes, no newline\)"):
        result = train(config, tmp_path, resume=True, progress=False)
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    assert steps_in(path) == [1, 2, 3]


def test_an_unparsable_row_before_the_end_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not a JSON row"):
        read_metrics(tmp_path, up_to=3)


def test_throughput_is_the_steps_tokens_and_flops_over_their_time():
    """Two steps of 3 s and four of 1 s (rows hold their interval's mean step time): 6 steps of 1024
    tokens in 10 s, and MFU the FLOPs of 6 steps over 10 s, not the mean of the rows' figures."""
    rows = [{"seconds": s, "tokens_per_s": 1024 / s, "mfu": 0.5 / s} for s in (3.0, 3.0, 1.0, 1.0, 1.0, 1.0)]
    tokens_per_s, mfu = metrics.throughput(rows)
    assert tokens_per_s == pytest.approx(6 * 1024 / 10) and mfu == pytest.approx(6 * 0.5 / 10)
