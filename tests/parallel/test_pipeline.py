"""The pipeline schedules' checks and error translation, on one process (the schedules themselves
run in the spawned worlds of tests/train/test_pipeline.py)."""
import pytest
import torch.distributed as dist

from shardmoe.parallel.exchange import ExchangeError
from shardmoe.parallel.pipeline import PipelineError, check_agreement, check_schedule, run_step


@pytest.mark.parametrize("name, pipeline, per_rank, microbatches, message", [
    ("zbv", 2, 1, 2, r"pipeline_schedule: expected one of gpipe, 1f1b, interleaved-1f1b, got 'zbv'"),
    ("gpipe", 2, 2, 2, r"stages_per_rank: expected 1 for gpipe \(one stage per rank; interleaved-1f1b runs several\)"),
    ("interleaved-1f1b", 2, 1, 2, r"stages_per_rank: expected at least 2 for interleaved-1f1b"),
    ("1f1b", 4, 1, 3, r"grad_accum_steps: expected at least p = 4 micro-batches for 1f1b"),
    ("interleaved-1f1b", 2, 2, 5, r"grad_accum_steps: expected a multiple of max\(1, grad_accum_steps // p\) = 2"),
    ("gpipe", 2, True, 2, r"stages_per_rank: expected an int >= 1, got True"),
])
def test_schedules_torch_cannot_run_are_refused_by_setting(name, pipeline, per_rank, microbatches, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(name, pipeline, per_rank, microbatches)


def test_the_schedules_torch_runs_pass():
    for name, per_rank, microbatches in (("gpipe", 1, 1), ("1f1b", 1, 2), ("interleaved-1f1b", 2, 2),
                                         ("interleaved-1f1b", 3, 6)):
        check_schedule(name, 2, per_rank, microbatches)


def test_a_stages_own_error_is_raised_as_itself_and_a_lost_peer_as_pipeline_error(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def wrapped(error):  # torch wraps a stage's forward error in a RuntimeError raised from it
        def step():
            try:
                raise error
            except Exception as cause:
                raise RuntimeError("[Stage 1] failed to run forward") from cause
        return step

    with pytest.raises(ValueError, match="^planted$"):
        run_step(wrapped(ValueError("planted")), stage=1)
    with pytest.raises(PipelineError, match=r"^pipeline stage 1 waited on a rank that failed, hung or left: "
                                            r"\[gloo/transport/tcp/pair.cc:553\] Connection closed by peer$"):
        run_step(wrapped(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")), stage=1)
    with pytest.raises(PipelineError, match="exchange over 'e' failed"):
        run_step(wrapped(ExchangeError("exchange over 'e' failed")), stage=1)
    assert run_step(lambda x, y=0: x + y, 2, y=3, stage=0) == 5


def test_settings_that_differ_are_named_with_their_ranks(monkeypatch):
    rows = [{"pipeline_schedule": "1f1b", "seq_len": 16}, {"pipeline_schedule": "1f1b", "seq_len": 16},
            {"pipeline_schedule": "gpipe", "seq_len": 16}, {"pipeline_schedule": "gpipe", "seq_len": 32}]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), rows))
    with pytest.raises(ValueError, match=r"^pipeline settings differ across ranks \(every rank must run the same model, "
                                         r"schedule and batch settings\): pipeline_schedule: ranks 0, 1 have '1f1b', "
                                         r"ranks 2, 3 have 'gpipe'; seq_len: ranks 0, 1, 2 have 16, rank 3 has 32$"):
        check_agreement(rows[0])
    rows[2:] = rows[:2]
    check_agreement(rows[0])
