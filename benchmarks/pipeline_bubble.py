"""The pipeline bubble measured on this CPU beside the simulator's prediction for the same layout.

    python benchmarks/pipeline_bubble.py                 # p=2, each schedule, m = 2, 4, 8 micro-batches
    python benchmarks/pipeline_bubble.py --steps 5 --microbatches 4,8

Spawns a 2-rank gloo world (p=2, one thread per rank: one core each on a 2-core machine) and trains
an 8-block float32 Transformer (d_model 128, 8 experts, top-2) through shardmoe.train.pipeline's
Pipeline with each schedule (gpipe, 1f1b, interleaved-1f1b with 2 stages per rank) and micro-batch
count m, micro-batches of 4 rows of 64 tokens. Per rank and step it times the step (schedule.step,
wall clock) and the rank's busy time: every stage forward and backward (PipelineStage's
forward_one_chunk and backward_one_chunk) and the last stage's loss. The measured bubble is
1 - busy / step, averaged over both ranks and the timed steps (after one warm-up step).

The prediction is shardmoe/simulate/pipeline.py's pipeline_seconds for the same p, v and m, fed
the measured busy time per chunk (busy / (m v), the mean over ranks): bubble (p - 1) / (m v + p - 1)
and step (m v + p - 1) t_c. It prices no transfer between the stages (the rows cross a local TCP
connection here, tens of microseconds against milliseconds of compute), so what it leaves out is
what the measured step holds beyond compute and fill: the P2P waits, the schedule's own work, and
one rank's chunks being slower than the other's (the last stage also computes the loss).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shardmoe.testing import run_distributed  # noqa: E402

ROWS, SEQ_LEN = 4, 64


def _config():
    from shardmoe.model.transformer import TransformerConfig
    from shardmoe.moe.config import MoEConfig

    return TransformerConfig(vocab_size=320, d_model=128, n_layers=8, n_q_heads=4, n_kv_heads=2, head_dim=32,
                             moe=MoEConfig(128, 256, 8, 2, aux_loss_coef=0.01))


def _measure(schedule: str, per_rank: int, microbatches: int, steps: int) -> dict:
    import torch.distributed as dist

    from shardmoe.mesh import Mesh
    from shardmoe.model.stages import rank_part
    from shardmoe.model.transformer import Transformer
    from shardmoe.train.data import Batch
    from shardmoe.train.pipeline import Pipeline

    torch.set_num_threads(1)
    config = _config()
    mesh = Mesh(pp=2)
    model = Transformer(config, mesh=mesh, part=rank_part(config.n_layers, mesh.stage, 2, per_rank))
    rows = ROWS * microbatches
    pipeline = Pipeline(model, mesh, schedule=schedule, stages_per_rank=per_rank, microbatches=microbatches, rows=rows,
                        seq_len=SEQ_LEN, balance_over="microbatch")
    busy = [0.0]

    def timed(function):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - started
        return run

    stages = getattr(pipeline.schedule, "_stages", None) or [pipeline.schedule._stage]
    for stage in stages:
        stage.forward_one_chunk = timed(stage.forward_one_chunk)
        stage.backward_one_chunk = timed(stage.backward_one_chunk)
    pipeline.schedule._loss_fn = timed(pipeline.schedule._loss_fn)
    generator = torch.Generator().manual_seed(0)
    step_times, busy_times = [], []
    for step in range(steps + 1):
        ids = torch.randint(0, 257, (rows, SEQ_LEN), generator=generator)
        starts = torch.zeros(rows, SEQ_LEN, dtype=torch.bool)
        starts[:, 0] = True
        model.zero_grad()
        dist.barrier()
        busy[0] = 0.0
        started = time.perf_counter()
        pipeline.step(Batch(ids, torch.roll(ids, -1, 1), starts), "microbatch")
        if step:  # the first step builds the schedule's buffers
            step_times.append(time.perf_counter() - started)
            busy_times.append(busy[0])
    return {"step": step_times, "busy": busy_times}


def main() -> None:
    from shardmoe.simulate.pipeline import pipeline_seconds

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up step)")
    parser.add_argument("--microbatches", default="2,4,8", help="comma-separated micro-batch counts")
    args = parser.parse_args()
    counts = [int(m) for m in args.microbatches.split(",")]
    print(f"p=2 on 2 gloo ranks, one thread each; {_config().n_layers} blocks, d_model {_config().d_model}, "
          f"micro-batches of {ROWS} x {SEQ_LEN} tokens, float32; {args.steps} timed steps per case")
    print(f"{'schedule':>16} {'m':>3} {'step ms':>8} {'busy ms':>8} {'bubble':>7} {'predicted':>9} "
          f"{'pred. step ms':>13} {'step/pred':>9}")
    for schedule, per_rank in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        for m in counts:
            ranks = run_distributed(_measure, 2, args=(schedule, per_rank, m, args.steps), timeout=600)
            steps = [s for r in ranks for s in r["step"]]
            busies = [b for r in ranks for b in r["busy"]]
            step = sum(steps) / len(steps)
            busy = sum(busies) / len(busies)
            bubble = sum(1 - b / s for b, s in zip(busies, steps)) / len(steps)
            predicted_step, predicted_bubble = pipeline_seconds(busy / (m * per_rank), 2, per_rank, m)
            print(f"{schedule:>16} {m:>3} {1e3 * step:>8.1f} {1e3 * busy:>8.1f} {100 * bubble:>6.1f}% "
                  f"{100 * predicted_bubble:>8.1f}% {1e3 * predicted_step:>13.1f} {step / predicted_step:>9.2f}")


if __name__ == "__main__":
    main()
