"""The training loop's pipeline: this rank's stages of the Transformer over the mesh's 'p' axis and
torch's schedules that run them (shardmoe/model/stages.py cuts the model, shardmoe/parallel/
pipeline.py names the schedules).

One optimizer step on a pipelined mesh, on every rank:
    micro-batches  this rank's rows of the step's batch ('B/d/e L', read by every stage's ranks
                   alike) in N = grad_accum_steps consecutive blocks, split by the schedule
    schedule       pipeline_schedule runs every micro-batch's forward and backward through the
                   stages; the last stage's loss is Transformer.loss of the final-normed rows,
                   divided by the step's token count, so the gradients sum to the whole batch's
    balance        balance_over = "microbatch": each MoE layer's aux, z and sequence-wise losses
                   of each micro-batch, weighted 1/N; "global": the losses of the whole step's
                   batch, whose loads exist once every micro-batch has routed, so a forward-only
                   pass of the micro-batches through the stages counts them first and each layer,
                   on whichever stage holds it, takes its share (MoE.balance_scope), as
                   train/accumulate.py does without a pipeline
    report         the loss from the last stage, the aux losses of every stage and every layer's
                   loads and selections, summed over the pipeline ranks, so every rank holds the
                   step's StepLosses of the whole model (the correction biases of a layer move by
                   its loads on the stage that holds it)
Evaluation runs the held-out batch forward in one micro-batch; sampling runs each window forward
in one (a stage per distinct window length, built once), and the last stage's logits are
broadcast over the pipeline ranks. Both go through torch's forward-only schedules.

The stages' shapes are declared (static metadata), every rank of a stage's mesh runs the same
schedule (so the MoE layers' collectives and handshakes meet), and the ranks check at build time
that they agree on the layout and the settings that shape what crosses between stages.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from shardmoe.model.stages import StageModule, rank_stages, stage_layers
from shardmoe.model.transformer import Losses, Transformer
from shardmoe.parallel import pipeline as schedules
from shardmoe.train.accumulate import StepLosses, add_scopes, check_micro_batches, dropped_pairs
from shardmoe.train.data import Batch


class Pipeline:
    """This rank's stages of `model` (the Part of the model this pipeline rank holds) on `mesh`
    (a Mesh with pipeline_size > 1), run by `schedule` with `microbatches` micro-batches of
    `rows` rows of `seq_len` tokens each. Builds nothing collective but the agreement check."""

    def __init__(self, model: Transformer, mesh, *, schedule: str, stages_per_rank: int, microbatches: int,
                 rows: int, seq_len: int, balance_over: str):
        config = model.config
        self.model, self.mesh, self.microbatches, self.device = model, mesh, microbatches, model.device
        self.count = mesh.pipeline_size * stages_per_rank
        check_micro_batches(rows, microbatches)  # torch's split of the rows would not refuse
        schedules.check_schedule(schedule, mesh.pipeline_size, stages_per_rank, microbatches)
        schedules.check_agreement({
            "mesh (pp, dp, ep, tp)": (mesh.pipeline_size, *(mesh.size(a) for a in ("d", "e", "t"))),
            "pipeline_schedule": schedule, "stages_per_rank": stages_per_rank, "grad_accum_steps": microbatches,
            "rows per micro-batch": rows // microbatches, "seq_len": seq_len, "balance_over": balance_over,
            "model": config.to_dict(), "dtype": str(model.dtype)})
        layers = stage_layers(config.n_layers, self.count)
        self.stage_indices = rank_stages(mesh.stage, mesh.pipeline_size, stages_per_rank)
        self.modules = [StageModule(model, s, layers[s], s == 0, s == self.count - 1) for s in self.stage_indices]
        self.last_rank = mesh.pipeline_ranks[(self.count - 1) % mesh.pipeline_size]
        self.holds_last = self.count - 1 in self.stage_indices
        self._num_tokens = 0
        self.schedule = schedules.build_schedule(schedule, self._stages(rows // microbatches, seq_len, grad=True),
                                                 microbatches, self._loss)
        self._forward: dict[tuple[int, int, int], object] = {}

    # -- stages ------------------------------------------------------------------------------

    def _stages(self, rows: int, length: int, grad: bool) -> list:
        """This rank's PipelineStages for micro-batches of rows x length tokens, their shapes declared."""
        from torch.distributed.pipelining import PipelineStage

        width, dtype, device = self.model.config.d_model, self.model.dtype, self.model.device
        tp = self.mesh.size("t")
        stages = []
        for module in self.modules:
            inputs = schedules.example((rows, length), torch.int64, device=device) if module.first else \
                schedules.example((rows, length, width // tp), dtype, grad, device)
            outputs = schedules.example((rows, length, width if module.last else width // tp), dtype, grad, device)
            module.output = (tuple(outputs.shape[2:]), dtype)
            stages.append(PipelineStage(module, module.index, self.count, device, input_args=inputs,
                                        output_args=outputs, group=self.mesh.pipeline_group))
        return stages

    def _forward_schedule(self, rows: int, length: int, microbatches: int):
        key = (rows, length, microbatches)
        if key not in self._forward:
            self._forward[key] = schedules.forward_schedule(self._stages(rows // microbatches, length, grad=False),
                                                            microbatches)
        return self._forward[key]

    def _loss(self, nx: Tensor, targets: Tensor) -> Tensor:
        return self.model.loss(nx, targets, self._num_tokens)

    def _run(self, step, ids: Tensor, is_seq_start: Tensor, **kwargs):
        """One pass of a schedule (its step) over this rank's rows, the stages' records cleared first;
        what the step returns (the last stage's merged output there)."""
        for module in self.modules:
            module.records.clear()
        return schedules.run_step(step, ids, is_seq_start=is_seq_start, stage=self.stage_indices[0], **kwargs)

    def _records(self, microbatches: int) -> list[list[tuple[int, dict, Tensor]]]:
        """[micro-batch][this rank's layers] (layer, MoE stats, aux loss) of the last pass."""
        for module in self.modules:
            if len(module.records) != microbatches:
                raise RuntimeError(f"pipeline stage {module.index}: ran {len(module.records)} forwards, expected "
                                   f"{microbatches}")
        return [[entry for module in self.modules for entry in module.records[m]] for m in range(microbatches)]

    # -- training ----------------------------------------------------------------------------

    def step(self, batch: Batch, balance_over: str) -> StepLosses:
        """Forward and backward of `batch` (this rank's rows) in the schedule's micro-batches; .grad
        holds this rank's part's gradients (before sync_grads). Returns the whole step's StepLosses,
        equal on every rank. Collective over the world."""
        count = self.microbatches
        layers = self.model.moe_layers()
        self._num_tokens = batch.targets.numel() * self.mesh.size(("d", "e"))
        share = balance_over == "global" and count > 1
        scopes = [None] * len(layers)
        if share:
            with torch.no_grad():
                self._run(self._forward_schedule(batch.ids.shape[0], batch.ids.shape[1], count).step, batch.ids,
                          batch.is_seq_start)
            counted = self._records(count)
            scopes = [functools.reduce(add_scopes, (part[j][1]["balance_scope"] for part in counted))
                      for j in range(len(layers))]
        losses: list[Tensor] = []
        try:
            for layer, scope in zip(layers, scopes):
                layer.balance_scope, layer.aux_loss_scale = scope, 1.0 if share else 1.0 / count
            self._run(self.schedule.step, batch.ids, batch.is_seq_start, target=batch.targets, losses=losses)
            records = self._records(count)
        finally:
            for layer in layers:
                layer.balance_scope, layer.aux_loss_scale = None, 1.0
        device = batch.ids.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        ce = torch.stack(losses).sum() if losses else zero
        aux = sum((entry[2].double() for part in records for entry in part), zero)
        ce, aux = self.model.global_losses(Losses(ce, ce, aux if share else aux / count))
        totals = torch.stack([ce.double() if self.holds_last else zero, aux.double()])
        dist.all_reduce(totals, group=self.mesh.pipeline_group)
        return StepLosses(totals[0], totals[1], *self._loads(records, device))

    def _loads(self, records, device: torch.device) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """(tokens kept [E], selections [E]) of every layer of the model, by global index, and the
        dropped pairs [], from this rank's layers' records summed with the other pipeline ranks'
        (every layer is on one stage: the others add zeros). On the device: no host wait."""
        n, E = self.model.config.n_layers, self.model.config.moe.num_experts
        counts = torch.zeros(2, n, E, dtype=torch.int64, device=device)
        for part in records:
            for index, stats, _ in part:
                counts[0, index] += stats["tokens_per_expert"].to(device)
                counts[1, index] += stats["selected_per_expert"].to(device)
        dropped = dropped_pairs([[stats for _, stats, _ in part] for part in records], device).reshape(1)
        dist.all_reduce(counts, group=self.mesh.pipeline_group)
        dist.all_reduce(dropped, group=self.mesh.pipeline_group)
        return list(counts[0].unbind()), list(counts[1].unbind()), dropped[0]

    # -- forward only ------------------------------------------------------------------------

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> Tensor:
        """The cross-entropy [] of `batch` (every rank's rows), forward only in one micro-batch, equal
        on every rank, on the device. Collective over the world."""
        rows, length = batch.ids.shape
        output = self._run(self._forward_schedule(rows, length, 1).step, batch.ids, batch.is_seq_start)
        total = torch.zeros(1, dtype=torch.float64, device=batch.ids.device)
        if self.holds_last:
            num_tokens = batch.targets.numel() * self.mesh.size(("d", "e"))
            loss = self.model.loss(output, batch.targets, num_tokens)
            total[0] = self.model.global_losses(Losses(loss, loss, torch.zeros((), dtype=loss.dtype)))[0]
        dist.all_reduce(total, group=self.mesh.pipeline_group)
        return total[0]

    @torch.no_grad()
    def logits(self, ids: Tensor, is_seq_start: Tensor) -> Tensor:
        """logits[B L V] (float64) of the rows, on every rank: the last stage's, broadcast over the
        pipeline ranks. Collective over the world; the sampler's model.logits."""
        rows, length = ids.shape
        output = self._run(self._forward_schedule(rows, length, 1).step, ids, is_seq_start)
        logits = torch.empty(rows, length, self.model.config.vocab_size, dtype=torch.float64, device=ids.device)
        if self.holds_last:
            logits.copy_(self.model.head_logits(output))
        dist.broadcast(logits, src=self.last_rank, group=self.mesh.pipeline_group)
        return logits

