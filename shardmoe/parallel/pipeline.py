"""Pipeline schedules over the mesh's 'p' axis, on torch.distributed.pipelining.

The schedules are torch's (its PipelineStage carries activations and their gradients between the
ranks of a pipeline group; nothing here moves a tensor): by the names a run sets,

    gpipe              ScheduleGPipe: every micro-batch forward, then every one backward
    1f1b               Schedule1F1B: P - s warm-up forwards on stage s, then one forward and one
                       backward in turn (torch needs micro-batches >= P)
    interleaved-1f1b   ScheduleInterleaved1F1B: v >= 2 stages per rank, 1F1B over them
                       (micro-batches a multiple of max(1, m // P) rounds)

Each runs one full backward per micro-batch and stage (torch.autograd.backward from the stage's
outputs), so the MoE layer's explicit backward, its balance-loss gradient (applied once per
forward) and its collectives run once per micro-batch, as without a pipeline. torch's zero-bubble
schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) split each
backward into an input pass and a later weight pass through the same graph; on the Transformer's
stages the input pass fails in torch (stage_backward_input: "Can't detach views in-place"), and the
MoE layer's backward computes its input and weight gradients in one operator, with its
collectives, so a split would run it twice. They are refused by name (ZERO_BUBBLE;
tests/parallel/test_pipeline.py runs ScheduleInterleavedZeroBubble to show the failure).

Every stage is built with its input and output shapes (PipelineStage's static metadata), so no
stage runs a shape-inference forward: a MoE layer's forward is collective over its stage's mesh
and must run on real rows only. The loss function sums (scale_grads=False): the loss a step
starts from is already divided by the step's token count.

Ranks must agree on everything that shapes the exchange between stages; check_agreement
all-gathers each rank's settings over the world and raises RankMismatchError on every rank,
naming each setting and the ranks that differ, before any stage communicates. A stage's error
surfaces on its own ranks as itself (unwrapped from torch's RuntimeError around a stage's
forward or backward); the other stages' ranks, waiting on it, fail within the process group's
timeout (sooner when the failed rank's process exits and its connections close) with a
PipelineError naming their stage and the cause (run_step). The pipeline groups wait as long as
the default group does (shardmoe.mesh.group_options), not torch's 30-minute default.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardmoe.parallel.consistency import RankMismatchError, by_value
from shardmoe.parallel.exchange import ExchangeError
from shardmoe.parallel.symmetric_heap import PeerExitedError, PeerTimeoutError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
# torch's schedules that split each backward into an input and a weight pass (module docstring)
ZERO_BUBBLE = ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")


class PipelineError(RuntimeError):
    """A pipeline step failed on this rank because another rank of the job failed, hung or left."""


def check_schedule_settings(name: str, stages_per_rank: int) -> None:
    """ValueError naming the setting for an unknown schedule or a stage count it does not run."""
    if name in ZERO_BUBBLE:
        raise ValueError(f"pipeline_schedule: {name!r} splits each backward into an input and a weight pass, which "
                         "the MoE layer's one-operator backward does not divide (torch fails on these stages: \"Can't "
                         f"detach views in-place\"); expected one of {', '.join(SCHEDULES)}")
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule: expected one of {', '.join(SCHEDULES)}, got {name!r}")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank: expected an int >= 1, got {stages_per_rank!r}")
    interleaved = name == "interleaved-1f1b"
    if interleaved and stages_per_rank < 2:
        raise ValueError(f"stages_per_rank: expected at least 2 for interleaved-1f1b (several stages per rank), "
                         f"got {stages_per_rank}")
    if not interleaved and stages_per_rank != 1:
        raise ValueError(f"stages_per_rank: expected 1 for {name} (one stage per rank; interleaved-1f1b runs "
                         f"several), got {stages_per_rank}")


def check_schedule(name: str, pipeline_size: int, stages_per_rank: int, microbatches: int) -> None:
    """ValueError naming the setting when torch's schedule `name` cannot run `microbatches`
    micro-batches over `pipeline_size` ranks with `stages_per_rank` stages each (no communication)."""
    check_schedule_settings(name, stages_per_rank)
    if name == "1f1b" and microbatches < pipeline_size:
        raise ValueError(f"grad_accum_steps: expected at least p = {pipeline_size} micro-batches for 1f1b (its "
                         f"warm-up fills every stage), got {microbatches}")
    rounds = max(1, microbatches // pipeline_size)
    if name == "interleaved-1f1b" and microbatches % rounds:
        raise ValueError(f"grad_accum_steps: expected a multiple of max(1, grad_accum_steps // p) = {rounds} for "
                         f"interleaved-1f1b on p = {pipeline_size}, got {microbatches}")


def build_schedule(name: str, stages: list, microbatches: int, loss_fn):
    """torch's schedule `name` over this rank's PipelineStages (one, or several for interleaved-1f1b),
    summing the micro-batches' losses' gradients."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ValueError(f"stages: expected one stage per rank for {name}, got {len(stages)}")
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return schedule(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


def forward_schedule(stages: list, microbatches: int):
    """A forward-only schedule over this rank's stages (no loss, no backward): GPipe's fill for one
    stage per rank, looped breadth-first for several."""
    from torch.distributed.pipelining import ScheduleGPipe, ScheduleLoopedBFS

    if len(stages) == 1:
        return ScheduleGPipe(stages[0], microbatches)
    return ScheduleLoopedBFS(stages, microbatches)


def check_agreement(settings: dict, what: str = "pipeline settings",
                    rule: str = "every rank must run the same model, schedule and batch settings") -> None:
    """All-gather every rank's `settings` (name -> a picklable value) over the world; raise
    RankMismatchError on every rank, naming each setting on which ranks differ and their values,
    e.g. "pipeline settings differ across ranks (RULE): pipeline_schedule: ranks 0, 1 have '1f1b',
    ranks 2, 3 have 'gpipe'". Collective over the default group; waits at most its timeout."""
    world = dist.get_world_size()
    gathered: list = [None] * world
    try:
        dist.all_gather_object(gathered, settings)
    except RuntimeError as err:
        raise PipelineError(f"{what}: the all-gather over every rank failed on rank {dist.get_rank()}: a peer "
                            f"failed, hung or left; cause: {first_line(err)}") from err
    problems = []
    for name in sorted(set().union(*(g.keys() for g in gathered))):
        values = [g.get(name) for g in gathered]
        if any(v != values[0] for v in values):
            problems.append(f"{name}: {by_value([repr(v) for v in values], range(len(values)))}")
    if problems:
        raise RankMismatchError(f"{what} differ across ranks ({rule}): " + "; ".join(problems))


def run_step(step, *args, stage: int, **kwargs):
    """Call step(*args, **kwargs) (a schedule's step or eval). An error of this rank's own stage is
    raised as itself; one that says another rank failed, hung or left is raised as PipelineError
    naming this rank and stage, and the cause."""
    try:
        return step(*args, **kwargs)
    except Exception as err:
        cause = _innermost(err)
        if lost_peer(cause):
            raise PipelineError(f"pipeline stage {stage} waited on a rank that failed, hung or left: "
                                f"{first_line(cause)}") from cause
        if cause is err:
            raise
        raise cause from None


def _innermost(err: BaseException) -> BaseException:
    """The error that started a chain of torch's wrappers (each raised `from` the one below)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def lost_peer(err: BaseException) -> bool:
    """Whether err says another rank failed, hung or left: torch raises DistError from the store and
    the process group, but gloo's transport timeouts and closed connections arrive as plain
    RuntimeErrors whose text names the gloo source file that raised them (gloo/transport/...);
    shardmoe's row exchange, shared-memory peers and pipeline say so by their error types."""
    return isinstance(err, (dist.DistError, ExchangeError, PeerExitedError, PeerTimeoutError, PipelineError)) or \
        (isinstance(err, RuntimeError) and "gloo/transport" in str(err))


def first_line(err: BaseException) -> str:
    """The first line of err's message (its type's name when it has none)."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def example(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = False,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor of the shape, dtype and device a PipelineStage declares for an input or output (its
    values are never read: only the metadata)."""
    return torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)
