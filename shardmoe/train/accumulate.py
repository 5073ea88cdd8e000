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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardmoe.model.transformer import Transformer
from shardmoe.moe.function import BalanceScope
from shardmoe.train.data import Batch

BALANCE_OVER = ("microbatch", "global")


@dataclass
class StepLosses:
    """What a step's micro-batches add up to: ce and aux of the global batch (equal on every rank),
    per MoE layer the global tokens kept [E] and selections [E], and the dropped pairs."""

    ce: float
    aux: float
    tokens_per_expert: list[torch.Tensor]
    selected_per_expert: list[torch.Tensor]
    dropped_tokens: int


def micro_batches(batch: Batch, count: int) -> list[Batch]:
    """batch [R L] as `count` consecutive row blocks [R/count L] (R divisible by count)."""
    rows = batch.ids.shape[0]
    if rows % count:
        raise ValueError(f"grad_accum_steps: expected a divisor of this rank's {rows} rows per step "
                         f"(batch_size / data-parallel ranks), got {count}")
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
            for part in parts:
                model(part.ids, part.is_seq_start, part.targets, num_tokens)
                scopes = [_add(s, layer.stats["balance_scope"]) for s, layer in zip(scopes, layers)]
    try:
        for i, layer in enumerate(layers):
            layer.balance_scope = scopes[i]
            layer.aux_loss_scale = 1.0 if share else 1.0 / count
        ce = aux = 0.0
        tokens = selected = None
        dropped = 0
        for part in parts:
            losses = model(part.ids, part.is_seq_start, part.targets, num_tokens)
            stats = model.moe_stats()
            part_tokens = [s["tokens_per_expert"] for s in stats]
            part_selected = [s["selected_per_expert"] for s in stats]
            tokens = part_tokens if tokens is None else [a + b for a, b in zip(tokens, part_tokens)]
            selected = part_selected if selected is None else [a + b for a, b in zip(selected, part_selected)]
            dropped += sum(int(s.get("dropped_tokens", 0)) for s in stats)
            losses.total.backward()
            part_ce, part_aux = model.global_losses(losses)
            ce += part_ce
            aux += part_aux if share else part_aux / count
    finally:
        for layer in layers:
            layer.balance_scope, layer.aux_loss_scale = None, 1.0
    return StepLosses(ce, aux, tokens, selected, dropped)


def _add(a: BalanceScope | None, b: BalanceScope) -> BalanceScope:
    if a is None:
        return b
    return BalanceScope(a.selected + b.selected, a.num_tokens + b.num_tokens, a.num_sequences + b.num_sequences)
