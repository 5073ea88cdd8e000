"""The Transformer cut into pipeline stages: which blocks each stage runs, which rank holds it, and
the module torch.distributed.pipelining's PipelineStage runs for it.

S = pipeline ranks x stages per rank stages, in model order: stage s runs blocks

    [floor(s n / S), floor((s + 1) n / S))          n = n_layers (every stage at least one)

stage 0 starts with the embedding and stage S - 1 ends with the final norm (its output is the
final-normed rows, which the schedule's loss function, Transformer.loss, turns into the
cross-entropy). Stage s lives on pipeline rank s mod P (torch's "loop" placement, which its
interleaved schedules assume): with one stage per rank, rank p runs stage p; with v per rank,
rank p runs stages p, p + P, ..., p + (v - 1) P, so its Part holds v separate runs of blocks.

Between stages pass the residual stream x[B L M/t] of a micro-batch (each rank to the rank with
its (d, e, t) on the next stage) and, backwards, its gradient; is_seq_start, from which every
stage computes the same segment ids, RoPE table and sequences (Transformer.context), is not
passed: every rank reads the batch and hands its rows to its stages as a keyword argument.

A model of your own with shardmoe layers is staged the same way: build each stage's layers with
`mesh=` the stage's (d, e, t) mesh (shardmoe.Mesh(..., pp=P) is it; a job DeviceMesh
("pp", "dp", "ep") gives it as job["dp", "ep"]), wrap the module that runs them in a
PipelineStage on the 'pp' group, and run a schedule (shardmoe/parallel/pipeline.py); every rank
of a stage's mesh must run the same schedule, as every MoE layer's collectives need.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .transformer import Part, Transformer


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """The blocks of each of `stages` stages (module docstring); ValueError when a stage would
    have none."""
    if n_layers < stages:
        raise ValueError(f"model.n_layers: expected at least one block per pipeline stage, {stages} stages "
                         f"(p x stages_per_rank), got {n_layers} blocks")
    return [range(s * n_layers // stages, (s + 1) * n_layers // stages) for s in range(stages)]


def rank_stages(pipeline_rank: int, pipeline_size: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank p runs: p, p + P, ... (torch's loop placement)."""
    return [pipeline_rank + k * pipeline_size for k in range(stages_per_rank)]


def rank_part(n_layers: int, pipeline_rank: int, pipeline_size: int, stages_per_rank: int = 1) -> Part:
    """The Part of the model pipeline rank p holds: the blocks of its stages, the embedding when it
    runs stage 0, the head when it runs the last stage."""
    count = pipeline_size * stages_per_rank
    layers = stage_layers(n_layers, count)
    mine = rank_stages(pipeline_rank, pipeline_size, stages_per_rank)
    return Part(tuple(i for s in mine for i in layers[s]), embedding=0 in mine, head=count - 1 in mine)


class StageModule(nn.Module):
    """One stage of a model part: forward(ids or x, is_seq_start=...) -> x[B L M/t] after its
    blocks (the first stage embeds the ids first; the last ends with the final norm: nx[B L M]).

    It checks its output's per-token shape and dtype against what its PipelineStage declared
    (`output`), so a stage that computes other activations than its neighbours expect fails by
    name instead of sending a buffer of another size. After each forward it appends its blocks' MoE statistics and aux losses to
    `records` (one entry per forward, in micro-batch order: every schedule runs a stage's forwards
    in that order), which the training step reads."""

    def __init__(self, model: Transformer, index: int, layers: range, first: bool, last: bool):
        super().__init__()
        self.model, self.index, self.layers, self.first, self.last = model, index, layers, first, last
        self.output: tuple[tuple[int, ...], torch.dtype] | None = None  # per-token shape [M/t] or [M], dtype
        self.records: list[list[tuple[int, dict, Tensor]]] = []

    def forward(self, x: Tensor, *, is_seq_start: Tensor) -> Tensor:
        inputs = self.model.context(is_seq_start)
        if self.first:
            x = self.model.embed(x)
        for i in self.layers:
            x = self.model.run_block(i, x, inputs)
        if self.last:
            x = self.model.head(x)
        if self.output is not None and (tuple(x.shape[2:]), x.dtype) != self.output:
            raise ValueError(f"pipeline stage {self.index}: expected outputs of {list(self.output[0])} per token in "
                             f"{self.output[1]}, got {list(x.shape[2:])} in {x.dtype} (every rank must run the same "
                             "model and dtype)")
        self.records.append([(i, self.model.blocks[i].moe.stats, self.model.blocks[i].moe.aux_loss.detach())
                             for i in self.layers])
        return x
