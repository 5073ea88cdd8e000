"""Routing: gate logits, softmax, top-k, renormalisation, capacity, balance losses,
and the gate's backward (grad_gate_gemm, stage 6 of the fused backward).

Shapes: S tokens, H hidden, E experts, k = top_k, N = number of kept (token, expert)
pairs. A pair is indexed p = t * k + j (token t, its j-th choice). Dispatch sorts
the kept pairs by expert, tokens in order within an expert, giving N "rows".

Forward, per token t (computed in float32 for fp32/bf16 inputs, float64 for float64):
  logits_t = x_t Wg                                  [S, E]
  p_t      = softmax(logits_t)                       [S, E]
  sel_t    = top-k indices of p_t                    [S, k]
  w_tj     = p_tj / sum_{i in sel_t} p_ti  (renormalize) else p_tj
  capacity EC = ceil(S / E * capacity_factor * k): an expert keeps its first EC
  pairs in token order; the others are dropped (no output, no gradient).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from shardmoe.moe.config import MoEConfig


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routing math and reductions run in float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Routing:
    """One forward's routing decisions.

    probs     [S, E] softmax of the logits (accumulation dtype)
    logsumexp [S]    logsumexp of the logits (for the z loss)
    top_idx   [S, k] selected experts, int64
    top_prob  [S, k] their probabilities p_tj
    weight    [S, k] combine weights w_tj (accumulation dtype)
    selected_per_expert [E] pairs routed to each expert before capacity (int64)
    kept_per_expert     [E] pairs each expert keeps (int64)
    row_pair  [N]    pair index p = t*k + j of each dispatched row, sorted by expert
    """

    probs: torch.Tensor
    logsumexp: torch.Tensor
    top_idx: torch.Tensor
    top_prob: torch.Tensor
    weight: torch.Tensor
    selected_per_expert: torch.Tensor
    kept_per_expert: torch.Tensor
    row_pair: torch.Tensor

    @property
    def dropped_pairs(self) -> int:
        return int(self.selected_per_expert.sum() - self.kept_per_expert.sum())

    def rows(self, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [N], combine weight w [N]) of each dispatched row."""
        return self.row_pair // top_k, self.weight.reshape(-1)[self.row_pair]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in declaration order, for ctx.save_for_backward; Routing(*tensors) rebuilds it."""
        return tuple(getattr(self, f.name) for f in fields(self))


def route(x: torch.Tensor, gate_weight: torch.Tensor, config: MoEConfig) -> Routing:
    """Routing of x [S, H] through gate_weight [H, E]; no autograd graph is built."""
    acc = accumulation_dtype(x.dtype)
    num_tokens, k, num_experts = x.shape[0], config.top_k, config.num_experts
    logits = x.to(acc) @ gate_weight.to(acc)
    logsumexp = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - logsumexp[:, None])
    top_prob, top_idx = torch.topk(probs, k, dim=-1)
    weight = top_prob / top_prob.sum(-1, keepdim=True) if config.renormalize else top_prob
    row_pair, selected, kept = dispatch_order(top_idx, num_experts, config.capacity(num_tokens))
    return Routing(probs, logsumexp, top_idx, top_prob, weight, selected, kept, row_pair)


def dispatch_order(top_idx: torch.Tensor, num_experts: int, capacity: int | None):
    """Sort the (token, expert) pairs by expert and apply the capacity.

    top_idx [S, k] -> row_pair [N] (kept pair indices, grouped by expert, token order
    within a group), selected_per_expert [E], kept_per_expert [E].
    """
    pair_expert = top_idx.reshape(-1)
    order = torch.argsort(pair_expert, stable=True)
    selected = torch.bincount(pair_expert, minlength=num_experts)
    if capacity is None:
        return order, selected, selected.clone()
    row_pair, kept = keep_first(order, pair_expert[order], selected, capacity)
    return row_pair, selected, kept


def keep_first(order: torch.Tensor, sorted_expert: torch.Tensor, selected: torch.Tensor,
               capacity: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of pairs `order` [M] sorted by expert (a stable sort keeps token order inside a group),
    keep each expert's first `capacity` (one int, or [E] per expert) -> (row_pair [N], kept [E]).

    sorted_expert [M] is each pair's expert and selected [E] the group sizes."""
    limit = torch.as_tensor(capacity, device=selected.device)
    group_start = torch.cumsum(selected, 0) - selected
    rank_in_expert = torch.arange(order.numel(), device=order.device) - group_start[sorted_expert]
    keep = rank_in_expert < (limit[sorted_expert] if limit.dim() else limit)
    return order[keep], torch.minimum(selected, limit)


def balance_loss(routing: Routing, config: MoEConfig, num_tokens: int | None = None) -> torch.Tensor:
    """Weighted aux + z loss (a scalar in the accumulation dtype).

    aux = E * sum_e (selected_e / S) * (sum_t p_te / S)   (Switch / Mixtral load balancing;
          selected_e counts top-k choices before capacity, as transformers does)
    z   = sum_t logsumexp(logits_t)^2 / S
    S is the rows of `routing` unless `num_tokens` says otherwise: a rank holding part of a
    batch passes the batch's S and its selected counts, and gets its share of the batch's loss.
    """
    probs = routing.probs
    num_tokens = probs.shape[0] if num_tokens is None else num_tokens
    loss = probs.new_zeros(())
    if num_tokens == 0:
        return loss
    if config.aux_loss_coef:
        fraction = routing.selected_per_expert.to(probs.dtype) / num_tokens
        loss = loss + config.aux_loss_coef * config.num_experts * (fraction * probs.sum(0)).sum() / num_tokens
    if config.z_loss_coef:
        loss = loss + config.z_loss_coef * routing.logsumexp.square().sum() / num_tokens
    return loss


def grad_gate_from_rows(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    routing: Routing,
    grad_weight_rows: torch.Tensor,
    grad_loss: torch.Tensor | None,
    config: MoEConfig,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 6 from the kept rows, as the fused and the expert-parallel backward both hold it:
    grad_weight_rows [N] are dw of the pairs routing.row_pair lists (in that order); they are
    scattered into dL/dw [S, k] (zero for dropped pairs) for grad_gate_gemm, whose arguments and
    result (dx [S, H], dWg [H, E]) the others are."""
    S, k = x.shape[0], routing.top_idx.shape[1]
    grad_weight = x.new_zeros(S * k, dtype=accumulation_dtype(x.dtype))
    grad_weight[routing.row_pair] = grad_weight_rows
    return grad_gate_gemm(x, gate_weight, routing, grad_weight.view(S, k), grad_loss, config, num_tokens)


def grad_gate_gemm(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    routing: Routing,
    grad_weight: torch.Tensor,
    grad_loss: torch.Tensor | None,
    config: MoEConfig,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 6: from dL/dw_tj to the gate weight and input gradients.

    grad_weight [S, k] holds dw_tj = g_t . y_j(t) (zero for dropped pairs); grad_loss is
    dL/d(balance_loss) or None.
      dp_tj    = (dw_tj - sum_{i in sel} w_ti dw_ti) / sum_{i in sel} p_ti   (renormalize)
               = dw_tj                                                       (otherwise)
      dp      += aux_coef * E * selected_e / S^2                             (aux loss)
      dlogits  = p * (dp - sum_e p_e dp_e)  +  z_coef * 2 lse_t p_t / S      (softmax, z loss)
      dWg = x^T dlogits  [H, E];   dx = dlogits Wg^T  [S, H]
    `num_tokens` is the S of the balance losses when `routing` holds a subset of the tokens
    (a tile of them, or one rank's share of a batch, as in balance_loss); by default its rows.
    Returns (dx [S, H], dWg [H, E]) in the accumulation dtype.
    """
    probs = routing.probs
    acc = probs.dtype
    num_tokens = probs.shape[0] if num_tokens is None else num_tokens
    grad_weight = grad_weight.to(acc)
    if config.renormalize:
        coupled = (routing.weight * grad_weight).sum(-1, keepdim=True)
        grad_top = (grad_weight - coupled) / routing.top_prob.sum(-1, keepdim=True)
    else:
        grad_top = grad_weight
    grad_probs = torch.zeros_like(probs).scatter_(1, routing.top_idx, grad_top)
    if grad_loss is not None and config.aux_loss_coef and num_tokens:
        scale = grad_loss.to(acc) * config.aux_loss_coef * config.num_experts / num_tokens**2
        grad_probs = grad_probs + scale * routing.selected_per_expert.to(acc)
    grad_logits = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
    if grad_loss is not None and config.z_loss_coef and num_tokens:
        scale = grad_loss.to(acc) * config.z_loss_coef * 2.0 / num_tokens
        grad_logits = grad_logits + scale * routing.logsumexp[:, None] * probs
    x_acc = x.to(acc)
    return grad_logits @ gate_weight.to(acc).t(), x_acc.t() @ grad_logits
