"""The training loop: data -> forward -> explicit backward -> gradient sync -> clip -> AdamW.

One optimizer step n (1-based) on every rank of the mesh:
    batch      this rank's rows of global batch n ('B/d/e L'; t ranks share rows)
    losses     model(batch): cross-entropy (mean over the global batch) + MoE aux losses
    backward   from this rank's total; the dense layers reduce-scatter their gradients over d
               (with grad_accum_steps N, forward and backward run over N micro-batches that add
               up to the same update: train/accumulate.py)
               (on a mesh with p > 1 the step's micro-batches run through the pipeline's stages
               instead, each rank holding its stages' blocks: train/pipeline.py)
    sync       model.sync_grads(): dense over e, MoE gate over (d, e), experts over d (within a
               pipeline stage's mesh)
    clip       the global gradient norm (all shards, each counted once) to max_grad_norm
    update     AdamW with the warm-up + cosine learning rate of step n, then each MoE correction
               bias from the step's global expert loads (when the model has them)
and rank 0 appends one JSON row per step to DIR/metrics.jsonl. The logged `loss` is the cross-entropy of
the global batch before the update (nats per token; per byte with the byte tokenizer); `aux_loss`
the summed weighted MoE losses; the load columns (metrics.load_columns) count each layer's tokens
per expert over the global batch. Under a mesh the MoE layer's stats["tokens_per_expert"] is already that global count: the
dispatch plan all-gathers every token-parallel rank's (d, e) counts before any row moves
(shardmoe/parallel/dispatch.py), and t peers hold the same tokens, so nothing is summed again.

Device and host. Everything a step touches lives on the run's device (train/device.py: the model,
the optimizer's moments, the batch, copied from pinned memory without waiting, the losses, the
gradient norm and the clipping factor, the loads). The step (optimizer_step) reads nothing back:
its figures stay on the device as a StepRecord until the log reads a whole interval's in one
transfer (read_records), every log_every steps and at the steps that need the host anyway
(evaluation, samples, the health report, checkpoints, the last). Each row of an interval gets the
interval's mean step time (tokens_per_s, mfu, seconds), a non-finite loss or gradient norm is
found there (the interval's rows are logged first), and the progress bar moves by the interval.

Every sample_every steps and at the last step the model continues prompts taken from the held-out
documents (train/sample.py), drawing from torch's global generator, and rank 0 appends them to
DIR/samples.jsonl; RunResult.samples holds the last round.

Determinism: initial weights come from config.seed, the batch stream is a pure function of
(seed, position), the optimizer is elementwise, and the samples are the only draws from torch's
global generator, which a fresh run seeds with config.seed and a checkpoint saves; so a run
resumed from a checkpoint computes bitwise the same losses, and samples the same text, as an
uninterrupted one (same mesh, same thread count).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardmoe.check.health import gradient_health
from shardmoe.model.stages import rank_part
from shardmoe.model.transformer import Transformer
from shardmoe.notation import MESH_AXES
from shardmoe.train.accumulate import StepLosses, accumulate_step
from shardmoe.train import sharded_checkpoint
from shardmoe.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from shardmoe.train.config import TrainConfig
from shardmoe.train.data import Batch, PackedBatches, document_prompts
from shardmoe.train.device import resolve_device
from shardmoe.train.flops import peak_flops, train_flops_per_token
from shardmoe.train.metrics import MetricsLog, load_columns, read_metrics, write_metrics
from shardmoe.train.optim import AdamW, clip_grads, global_grad_norm, learning_rate
from shardmoe.train.pipeline import Pipeline
from shardmoe.train.sample import (PROMPTS, SampleLog, prompt_length, read_samples, sample, samples_path,
                                   write_samples)
from shardmoe.train.token_cache import open_tokens
from shardmoe.train.tokenizer import Tokenizer, check_vocab, load_tokenizer


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became non-finite (the step's row is logged first)."""


@dataclass
class RunResult:
    """A run's model (this rank's shards) and its metric rows: the ones kept from before a resume,
    then this run's. Loss values are global, so every rank holds the same rows."""

    model: Transformer
    metrics: list[dict] = field(default_factory=list)
    peak_flops: float = 0.0  # FLOP/s of one device, the MFU's denominator
    peak_source: str = ""  # where peak_flops comes from (train/flops.py peak_flops)
    start_step: int = 0  # steps already taken when this run began (the checkpoint's step on resume)
    samples: list[dict] = field(default_factory=list)  # the last round's {"step", "prompt", "sample"}

    @property
    def new_metrics(self) -> list[dict]:
        return [m for m in self.metrics if m["step"] > self.start_step]


def build_streams(config: TrainConfig, dp_rank: int = 0, dp_size: int = 1, *,
                  progress: bool = False) -> tuple[PackedBatches, PackedBatches]:
    """(training stream, held-out stream in corpus order) of this token-parallel rank, read from the
    token cache (built first if needed, with a progress bar when `progress`). ValueError naming the
    setting for an unreadable tokenizer, one the model's vocabulary does not cover, data that is
    missing, empty or too small for one batch."""
    tokenizer = load_tokenizer(config.tokenizer)
    check_vocab(config.model.vocab_size, tokenizer)
    tokens = open_tokens(config.data, tokenizer, config.val_fraction, config.token_cache, progress=progress)
    common = dict(bos=tokenizer.bos, dp_rank=dp_rank, dp_size=dp_size, source=tokens.key,
                  tokenizer_digest=tokenizer.digest)

    def stream(split: str, split_tokens, documents: int, remedy: str, **options) -> PackedBatches:
        try:
            return PackedBatches(split_tokens, config.seq_len, config.batch_size, num_documents=documents,
                                 **options, **common)
        except ValueError as err:
            raise ValueError(f"data: the {split} documents are too small for batch_size={config.batch_size}, "
                             f"seq_len={config.seq_len}: {err}; {remedy}") from None

    train = stream("training", tokens.train, tokens.meta["train_documents"], "lower batch_size or seq_len",
                   seed=config.seed)
    val = stream("held-out", tokens.val, tokens.meta["val_documents"],
                 "lower batch_size or seq_len, or raise val_fraction", shuffle=False)
    return train, val


@dataclass
class StepRecord:
    """One optimizer step's figures, on the device until the log reads them (read_records); flagged:
    the health report's flags (read on the host on health steps only)."""

    step: int
    lr: float
    losses: StepLosses
    grad_norm: torch.Tensor
    flagged: list[str]


def optimizer_step(model: Transformer, optimizer: AdamW, batch: Batch, config: TrainConfig, step: int, *,
                   pipeline: Pipeline | None = None, token_shards: int = 1, last: int | None = None,
                   mesh=None) -> StepRecord:
    """Optimizer step `step` (1-based) on this rank's rows `batch` (on the model's device): forward
    and backward (through the pipeline's stages when one is given), gradient sync, global norm,
    clipping, AdamW at the step's learning rate, the correction biases. Nothing is read on the host
    but on the health report's steps. Collective under a mesh."""
    params = list(model.named_parameters())
    optimizer.zero_grad()
    with _autocast(config, model.device):
        if pipeline is not None:
            losses = pipeline.step(batch, config.balance_over)
        else:
            losses = accumulate_step(model, batch, config.grad_accum_steps, config.balance_over, token_shards)
    model.sync_grads()
    grad_norm = global_grad_norm([(p.grad, model.replicas(n)) for n, p in params])
    flagged = _flagged(model, params, config, step, config.steps if last is None else last, mesh)
    clip_grads([p.grad for _, p in params], grad_norm, config.max_grad_norm)
    lr = learning_rate(step, config.lr, config.warmup_steps, config.steps, config.min_lr_ratio)
    optimizer.step(lr)
    model.update_correction_biases(losses.selected_per_expert)  # this step's global loads (DeepSeek-V3)
    return StepRecord(step, lr, losses, grad_norm, flagged)


def read_records(records: list[StepRecord]) -> list[dict]:
    """The metric rows of `records` but for the timing columns, read from the device in one
    transfer: step, loss, aux_loss, lr, grad_norm, dropped_tokens and the load columns."""
    figures = [torch.cat([torch.stack([t.double() for t in (r.losses.ce, r.losses.aux, r.grad_norm,
                                                             r.losses.dropped_tokens)]),
                          torch.stack(r.losses.tokens_per_expert).double().flatten()]) for r in records]
    values = torch.stack(figures).tolist()
    rows = []
    for record, row in zip(records, values):
        loads = torch.tensor(row[4:]).view(len(record.losses.tokens_per_expert), -1)
        rows.append({"step": record.step, "loss": row[0], "aux_loss": row[1], "lr": record.lr, "grad_norm": row[2],
                     "dropped_tokens": int(row[3]), **load_columns(loads.long())})
        if record.flagged:
            rows[-1]["flagged"] = record.flagged
    return rows


def train(config: TrainConfig, out_dir: str | Path | None, *, mesh=None, resume: bool = False,
          stop_after: int | None = None, progress: bool = True) -> RunResult:
    """Train to config.steps (or only up to step stop_after, as an interrupted run would).

    out_dir None writes nothing (no metrics file, no checkpoint). Collective under a mesh: every
    rank calls it with the same arguments. The device is config.device's (under a mesh, auto is
    the process group's: cuda under NCCL, cpu under gloo)."""
    rank0 = mesh is None or mesh.rank == 0
    token_shards = 1 if mesh is None else mesh.size(("d", "e"))
    token_rank = 0 if mesh is None else mesh.coord(("d", "e"))
    group_device = None if mesh is None or mesh.device_mesh is None else mesh.device_mesh.device_type
    device = resolve_device(config.device, group_device)
    data, val = build_streams(config, token_rank, token_shards)
    tokenizer = load_tokenizer(config.tokenizer)
    prompts = document_prompts(val.tokens, val.bos, PROMPTS, prompt_length(config.seq_len))
    pipelined = mesh is not None and mesh.pipeline_size > 1
    part = rank_part(config.model.n_layers, mesh.stage, mesh.pipeline_size, config.stages_per_rank) if pipelined \
        else None
    model = Transformer(config.model, mesh=mesh, backward=config.backward, dtype=config.param_dtype, seed=config.seed,
                        part=part, device=device, activation_checkpointing=config.activation_checkpointing)
    pipeline = Pipeline(model, mesh, schedule=config.pipeline_schedule, stages_per_rank=config.stages_per_rank,
                        microbatches=config.grad_accum_steps, rows=config.batch_size // token_shards,
                        seq_len=config.seq_len, balance_over=config.balance_over) if pipelined else None
    optimizer = AdamW(model.named_parameters(), betas=(config.beta1, config.beta2), eps=config.adam_eps,
                      weight_decay=config.weight_decay)

    start, history, samples = 0, [], []
    if resume:
        start, data_state = load_checkpoint(latest_checkpoint(out_dir), model, optimizer, mesh)
        data.load_state_dict(data_state)
        history = read_metrics(out_dir, up_to=start)
        samples = read_samples(out_dir, up_to=start)
    else:
        torch.manual_seed(config.seed)  # the samples' draws; a resume restores the checkpoint's state
    if out_dir is not None and rank0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_metrics(out_dir, history)  # drops rows logged after the checkpoint (or a fresh run's old rows)
        if samples or samples_path(out_dir).exists():
            write_samples(out_dir, samples)

    last = config.steps if stop_after is None else min(stop_after, config.steps)
    peak = peak_flops(device, config.autocast_dtype or config.param_dtype)
    result = RunResult(model, history, peak.flops, peak.source, start)
    if start >= last:
        return result
    flops_per_step = train_flops_per_token(config.model, config.seq_len) * config.batch_size * config.seq_len
    world = 1 if mesh is None else mesh.world_size
    sharded = config.sharded_checkpoints(world)
    bar = _progress_bar(progress and rank0, start, last)
    metrics_log = MetricsLog(out_dir) if out_dir is not None and rank0 else None
    sample_log = SampleLog(out_dir) if out_dir is not None and rank0 and config.sample_tokens else None
    pending: list[StepRecord] = []
    held_out = next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None)  # the bar's latest
    try:
        interval_started = time.perf_counter()
        for step in range(start + 1, last + 1):
            pending.append(optimizer_step(model, optimizer, next(data).to(device), config, step, pipeline=pipeline,
                                          token_shards=token_shards, last=last, mesh=mesh))
            evaluates = bool(config.eval_batches) and (step == last or (config.eval_every and
                                                                         step % config.eval_every == 0))
            samples_now = bool(config.sample_tokens and prompts) and (step == config.steps or (
                config.sample_every and step % config.sample_every == 0))
            periodic = config.checkpoint_every and step % config.checkpoint_every == 0
            saves = out_dir is not None and (step == last or periodic)
            if not (step % config.log_every == 0 or step == last or evaluates or samples_now or saves
                    or pending[-1].flagged):
                continue
            rows = read_records(pending)  # the host waits here, once per interval
            seconds = (time.perf_counter() - interval_started) / len(rows)
            for row in rows:
                row.update(tokens_per_s=config.batch_size * config.seq_len / seconds,
                           mfu=flops_per_step / seconds / (result.peak_flops * world), seconds=seconds)
            pending = []
            for row in rows:
                if row.get("flagged") and bar is not None:
                    bar.write(f"step {row['step']}: gradient health flags {', '.join(row['flagged'])}")
            if evaluates:
                with _autocast(config, device):
                    rows[-1]["val_loss"] = evaluate(pipeline or model, val, config.eval_batches)
            result.metrics.extend(rows)
            if metrics_log is not None:
                for row in rows:
                    metrics_log.append(row)
            if bar is not None:
                held_out = rows[-1].get("val_loss", held_out)
                bar.set_postfix(loss=f"{rows[-1]['loss']:.3f}", **({"val": f"{held_out:.3f}"} if held_out is not None
                                                                  else {}),
                                tok_s=f"{rows[-1]['tokens_per_s']:.0f}", mfu=f"{rows[-1]['mfu']:.1%}")
                bar.update(len(rows))
            for row in rows:
                if not math.isfinite(row["loss"]) or not math.isfinite(row["grad_norm"]):
                    raise TrainingDiverged(f"training diverged at step {row['step']}: loss {row['loss']}, gradient "
                                           f"norm {row['grad_norm']}; lower lr or raise warmup_steps")
            if samples_now:
                with _autocast(config, device):
                    result.samples = _samples(pipeline or model, tokenizer, prompts, config, step)
                if sample_log is not None:
                    sample_log.append(result.samples)
            if saves:
                saved = (out_dir, model, optimizer, step, config.to_dict(), config.resume_identity(), data.state_dict())
                if sharded:
                    sharded_checkpoint.save(*saved, mesh)
                if not sharded or step == config.steps:  # a sharded run's export: the single file
                    save_checkpoint(*saved, write=rank0)
            interval_started = time.perf_counter()
    finally:
        if bar is not None:
            bar.close()
        if metrics_log is not None:
            metrics_log.close()
        if sample_log is not None:
            sample_log.close()
    return result


def _samples(model: Transformer | Pipeline, tokenizer: Tokenizer, prompts, config: TrainConfig, step: int) -> list[dict]:
    """A continuation of each prompt, drawn from torch's global generator (collective under a mesh;
    `model` a Pipeline on a pipelined one, whose logits are the last stage's on every rank)."""
    rows = []
    for prompt in prompts:
        try:
            continuation = sample(model, prompt, config.sample_tokens, tokenizer=tokenizer, seq_len=config.seq_len,
                                  temperature=config.sample_temperature)
        except ValueError as err:  # the update of this step made the weights non-finite
            raise TrainingDiverged(f"training diverged at step {step}: {err}; lower lr or raise warmup_steps") from None
        rows.append({"step": step, "prompt": tokenizer.decode(prompt), "sample": tokenizer.decode(continuation)})
    return rows


@torch.no_grad()
def evaluate(model: Transformer | Pipeline, val: PackedBatches, num_batches: int) -> float:
    """Mean cross-entropy over the first num_batches held-out batches (collective; through the
    stages when `model` is a Pipeline)."""
    count = min(num_batches, val.batches_per_epoch)
    total = torch.zeros((), dtype=torch.float64, device=model.device)
    for batch in itertools.islice(val.epoch_batches(0), count):
        batch = batch.to(model.device)
        if isinstance(model, Pipeline):
            total += model.eval_loss(batch)
        else:
            total += model.global_losses(model(batch.ids, batch.is_seq_start, batch.targets))[0]
    return total.item() / count


def _flagged(model: Transformer, params, config: TrainConfig, step: int, last: int, mesh) -> list[str]:
    """'name: status' of parameters the gradient health report flags, judged on the full gradients
    (reduced over the shards, so a flag raised on any rank is in every rank's list; on a pipelined
    mesh each stage judges its own parameters and the pipeline ranks' lists are joined). Collective."""
    if not config.health_every or (step % config.health_every and step != last):
        return []
    if mesh is None or mesh.pipeline_size == 1:
        return [f"{e.name}: {e.status}" for e in gradient_health(params, replicas=model.replicas).flagged]
    stage_mesh = mesh.size() > 1
    report = gradient_health(params, replicas=model.replicas if stage_mesh else None,
                             group=mesh.group(MESH_AXES) if stage_mesh else None)
    gathered: list = [None] * mesh.pipeline_size
    dist.all_gather_object(gathered, [f"{e.name}: {e.status}" for e in report.flagged], group=mesh.pipeline_group)
    return [flag for flags in gathered for flag in flags]


def _autocast(config: TrainConfig, device: torch.device):
    """torch.autocast on the device in config.autocast_dtype, or nothing (a no-op context)."""
    dtype = config.autocast_dtype
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _progress_bar(enabled: bool, start: int, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
