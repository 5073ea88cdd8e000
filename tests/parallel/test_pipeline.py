"""The pipeline schedules' checks and error translation, on one process (the schedules themselves
run in the spawned worlds of tests/train/test_pipeline.py); and, on 2 ranks, why the zero-bubble
schedules are refused: torch's ScheduleInterleavedZeroBubble fails on the Transformer's stages."""
import pytest
import torch
import torch.distributed as dist

from shardmoe.parallel.exchange import ExchangeError
from shardmoe.parallel.pipeline import PipelineError, check_agreement, check_schedule, run_step
from shardmoe.testing import run_distributed
from shardmoe.testing.distributed import RankFailed


@pytest.mark.parametrize("name, pipeline, per_rank, microbatches, message", [
    ("zbv", 2, 1, 2, r"pipeline_schedule: expected one of gpipe, 1f1b, interleaved-1f1b, got 'zbv'"),
    ("gpipe", 2, 2, 2, r"stages_per_rank: expected 1 for gpipe \(one stage per rank; interleaved-1f1b runs several\)"),
    ("interleaved-1f1b", 2, 1, 2, r"stages_per_rank: expected at least 2 for interleaved-1f1b"),
    ("1f1b", 4, 1, 3, r"grad_accum_steps: expected at least p = 4 micro-batches for 1f1b"),
    ("interleaved-1f1b", 2, 2, 5, r"grad_accum_steps: expected a multiple of max\(1, grad_accum_steps // p\) = 2"),
    ("gpipe", 2, True, 2, r"stages_per_rank: expected an int >= 1, got True"),
    ("interleaved-zero-bubble", 2, 2, 2, r"pipeline_schedule: 'interleaved-zero-bubble' splits each backward into an "
                                         r"input and a weight pass"),
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


def _zero_bubble_step():
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

    from shardmoe.mesh import Mesh
    from shardmoe.model.stages import rank_part
    from shardmoe.model.transformer import Transformer, TransformerConfig
    from shardmoe.moe.config import MoEConfig
    from shardmoe.train.data import Batch
    from shardmoe.train.pipeline import Pipeline

    torch.set_num_threads(1)
    config = TransformerConfig(vocab_size=260, d_model=16, n_layers=4, n_q_heads=4, n_kv_heads=2, head_dim=4,
                               moe=MoEConfig(16, 8, 4, 2, aux_loss_coef=0.01))
    mesh = Mesh(pp=2)
    model = Transformer(config, mesh=mesh, part=rank_part(4, mesh.stage, 2, 2))
    pipeline = Pipeline(model, mesh, schedule="interleaved-1f1b", stages_per_rank=2, microbatches=2, rows=4, seq_len=8,
                        balance_over="microbatch")
    pipeline.schedule = ScheduleInterleavedZeroBubble(pipeline._stages(2, 8, grad=True), 2, loss_fn=pipeline._loss,
                                                      scale_grads=False)
    ids = torch.randint(0, 257, (4, 8), generator=torch.Generator().manual_seed(0))
    starts = torch.zeros(4, 8, dtype=torch.bool)
    starts[:, 0] = True
    pipeline.step(Batch(ids, ids, starts), "microbatch")


def test_torchs_zero_bubble_schedule_fails_on_the_transformers_stages():
    with pytest.raises(RankFailed) as caught:
        run_distributed(_zero_bubble_step, 2, timeout=120, collective_timeout=5, report_grace=10)
    failed = {caught.value.rank: caught.value.details, **caught.value.others}
    assert any("Can't detach views in-place" in text for text in failed.values()), failed
