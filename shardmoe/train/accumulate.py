"""One optimizer step's forward and backward over grad_accum_steps micro-batches.

The step's batch [B/d/e L] (this rank's rows) is split into N = grad_accum_steps micro-batches of
B/(d e N) rows; each runs forward and backward, and the gradients add up in .grad. The update is
the one of the whole batch in one piece:
  cross-entropy   each micro-batch's summed over its tokens, divided by the step's token count
                  (every rank's, every micro-batch's): the parts sum to the step's mean
  balance losses  balance_over = "microbatch": each micro-batch's own aux, z and sequence-wise
                  losses, averaged over the N (their gradients ride on the MoE outputs with
                  aux_loss_scale = 1/N); = "global": the losses of the whole step's batch, whose
                  aux loss counts the experts' selections over all of it (torchtitan#4772). Those
                  counts exist only after every micro-batch has routed, so a first pass runs the
                  micro-batches forward under no_grad to count them (one extra forward: about a
                  third of a step), then each micro-batch's loss is its share of the step's
                  (MoE.balance_scope, moe/function.py BalanceScope). Routing is deterministic, so
                  the counting pass routes exactly as the training passes do.
With N = 1 both settings are the plain step. Loads and dropped tokens are summed over the parts.
Everything stays on the device: the loop reads a step's StepLosses once per logging interval.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from shardmoe.model.transformer import Transformer
from shardmoe.moe.function import BalanceScope
from shardmoe.train.data import Batch

BALANCE_OVER = ("microbatch", "global")


@dataclass
class StepLosses:
    """What a step's micro-batches add up to, tensors on the model's device: ce and aux [] of the
    global batch (equal on every rank), per MoE layer the global tokens kept [E] and selections
    [E], and the dropped pairs []."""

    ce: torch.Tensor
    aux: torch.Tensor
    tokens_per_expert: list[torch.Tensor]
    selected_per_expert: list[torch.Tensor]
    dropped_tokens: torch.Tensor


def check_micro_batches(rows: int, count: int) -> None:
    """Raise ValueError unless this rank's `rows` per step split into `count` micro-batches."""
    if rows % count:
        raise ValueError(f"grad_accum_steps: expected a divisor of this rank's {rows} rows per step "
                         f"(batch_size / data-parallel ranks), got {count}")


def micro_batches(batch: Batch, count: int) -> list[Batch]:
    """batch [R L] as `count` consecutive row blocks [R/count L] (R divisible by count)."""
    check_micro_batches(batch.ids.shape[0], count)
    return [Batch(*(t.chunk(count)[i] for t in batch)) for i in range(count)]


def accumulate_step(model: Transformer, batch: Batch, count: int, balance_over: str, token_shards: int) -> StepLosses:
    """Forward and backward of `batch` in `count` micro-batches; .grad holds the step's gradients
    (before sync_grads). Collective under a mesh, as the model's forward is."""
    parts = micro_batches(batch, count)
    layers = model.moe_layers()
    num_tokens = batch.targets.numel() * token_shards
    share = balance_over == "global" and count > 1
    scopes = [None] * len(layers)
    if share:
        with torch.no_grad():
            counted = []
            for part in parts:
                model(part.ids, part.is_seq_start, part.targets, num_tokens)
                counted.append([layer.stats["balance_scope"] for layer in layers])
        scopes = [functools.reduce(add_scopes, per_layer) for per_layer in zip(*counted)]
    ce = aux = torch.zeros((), dtype=torch.float64, device=batch.ids.device)
    stats = []  # [part][layer] each micro-batch's routing statistics
    try:
        for layer, scope in zip(layers, scopes):
            layer.balance_scope, layer.aux_loss_scale = scope, 1.0 if share else 1.0 / count
        for part in parts:
            losses = model(part.ids, part.is_seq_start, part.targets, num_tokens)
            stats.append(model.moe_stats())
            losses.total.backward()
            part_ce, part_aux = model.global_losses(losses)
            ce = ce + part_ce.double()
            aux = aux + (part_aux.double() if share else part_aux.double() / count)
    finally:
        for layer in layers:
            layer.balance_scope, layer.aux_loss_scale = None, 1.0
    per_layer = list(zip(*stats))
    return StepLosses(ce, aux, [sum(s["tokens_per_expert"] for s in layer) for layer in per_layer],
                      [sum(s["selected_per_expert"] for s in layer) for layer in per_layer],
                      dropped_pairs(stats, ce.device))


def dropped_pairs(stats, device: torch.device) -> torch.Tensor:
    """The dropped (token, expert) pairs [] of routing statistics stats[part][layer] (a tensor or a
    count each), summed on `device`."""
    counts = [torch.as_tensor(s.get("dropped_tokens", 0), device=device) for part in stats for s in part]
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64, device=device)


def add_scopes(a: BalanceScope, b: BalanceScope) -> BalanceScope:
    """The balance scope of two micro-batches together."""
    return BalanceScope(a.selected + b.selected, a.num_tokens + b.num_tokens, a.num_sequences + b.num_sequences)
