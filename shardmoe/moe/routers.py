"""The router families' pieces that routing.route composes: score function, expert selection,
sequence bookkeeping of the sequence-wise balance loss, and the correction-bias update.

Shapes: S tokens, E experts, k = top_k, Q sequences, G = E / n_group experts per group.

  scores     s = softmax(logits) or sigmoid(logits)                          [S, E]
  selection  c = s + correction_bias (a buffer: selection only, no gradient)  [S, E]
             group-limited (n_group > 1): a group's score is the sum of its two best c
             (its one c when G = 1); experts outside the topk_group best groups get c = -inf
             top_idx = the k largest c, in descending order                    [S, k]
  Ties go to the lowest index, at both levels (a stable descending sort). torch.topk does not
  promise that (on CPU it returns index 2 of four equal values for k = 1), so the selection uses
  it only where no tie can matter (top_indices); transformers' routers use it everywhere, and may
  pick another of equal candidates.
"""
from __future__ import annotations

import torch

from shardmoe.moe.config import MoEConfig


def scores_from_logits(logits: torch.Tensor, logsumexp: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """s [S, E]: exp(logits - logsumexp) (softmax) or sigmoid(logits)."""
    if config.score_func == "softmax":
        return torch.exp(logits - logsumexp[:, None])
    return torch.sigmoid(logits)


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, descending, ties to the lowest index
    (NaN above every number, as a stable descending sort puts it).

    Up to 32-bit floats: one torch.topk over int64 keys that order as the values and then by the
    lower index, so its answer is the stable sort's with no tie to look for: a tie check would be
    a host read of the device every step. The key is the value's bits made monotonic (negative
    floats' magnitude bits flipped; -0 taken as +0 and every NaN as one NaN first) times 2^16, plus
    65535 - index. float64 (the CPU checks) has no room for the index in 64 bits: torch.topk of k + 1
    first (4x faster than a full sort at E = 64 and k = 8), and the rows with equal neighbours among
    those (a tie inside the top k or at its edge) or a NaN take the stable descending sort."""
    width = values.shape[-1]
    if k >= width:
        return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    if values.dtype != torch.float64:
        v = values.float()
        v = torch.where(v.isnan(), float("nan"), v + 0.0)
        bits = v.view(torch.int32)
        ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
        lower_first = 65535 - torch.arange(width, device=values.device)
        return torch.topk(ordered * 65536 + lower_first, k, dim=-1).indices
    top = torch.topk(values, k + 1, dim=-1)
    indices = top.indices[..., :k]
    tied = (top.values[..., 1:] == top.values[..., :-1]).any(-1) | top.values.isnan().any(-1)
    if tied.any():
        indices = indices.clone()
        indices[tied] = torch.sort(values[tied], dim=-1, descending=True, stable=True).indices[..., :k]
    return indices


def select_experts(scores: torch.Tensor, config: MoEConfig, correction_bias: torch.Tensor | None) -> torch.Tensor:
    """top_idx [S, k] from the scores [S, E] (see the module docstring); builds no graph."""
    choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)
    if config.n_group > 1:
        num_tokens, per_group = choice.shape[0], config.num_experts // config.n_group
        grouped = choice.reshape(num_tokens, config.n_group, per_group)
        group_score = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)  # [S, n_group]
        allowed = torch.zeros(num_tokens, config.n_group, dtype=torch.bool, device=choice.device)
        allowed.scatter_(1, top_indices(group_score, config.topk_group), True)
        choice = choice.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
    return top_indices(choice, config.top_k)


def token_sequence_ids(num_tokens: int, sequence_starts: torch.Tensor | None, device=None) -> torch.Tensor:
    """[S] int64: the sequence of each token, sequences beginning at sequence_starts (a strictly
    increasing 1-D int tensor starting at 0; None: one sequence). Raises ValueError otherwise."""
    if sequence_starts is None:
        return torch.zeros(num_tokens, dtype=torch.int64, device=device)
    starts = sequence_starts
    if not isinstance(starts, torch.Tensor) or starts.dim() != 1 or starts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sequence_starts: expected a 1-D int tensor of token offsets, got "
                         f"{type(starts).__name__} {getattr(starts, 'shape', '')} {getattr(starts, 'dtype', '')}")
    if num_tokens == 0:
        if starts.numel():
            raise ValueError(f"sequence_starts: expected no starts for 0 tokens, got {starts.tolist()}")
        return torch.zeros(0, dtype=torch.int64, device=device)
    if starts.numel() == 0 or int(starts[0]) != 0 or bool((starts[1:] <= starts[:-1]).any()) \
            or int(starts[-1]) >= num_tokens:
        raise ValueError(f"sequence_starts: expected strictly increasing token offsets from 0 below "
                         f"{num_tokens} (the tokens), got {starts.tolist()}")
    marks = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    marks[starts.to(device=device, dtype=torch.int64)] = 1
    return torch.cumsum(marks, 0) - 1


def sequence_selections(top_idx: torch.Tensor, token_sequence: torch.Tensor, num_experts: int):
    """(selected [Q, E], tokens [Q]) int64: top-k choices of each expert and tokens per sequence."""
    num_sequences = int(token_sequence.max()) + 1 if token_sequence.numel() else 0
    flat = (token_sequence[:, None] * num_experts + top_idx).reshape(-1)
    selected = torch.bincount(flat, minlength=num_sequences * num_experts).view(num_sequences, num_experts)
    return selected, torch.bincount(token_sequence, minlength=num_sequences)


def balance_scores(scores: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """s' [S, E], the scores the balance losses average: s itself (softmax: each row sums to 1),
    s / sum_e s_e for sigmoid (DeepSeek-V3's normalised affinities)."""
    if config.score_func == "softmax":
        return scores
    return scores / scores.sum(-1, keepdim=True)


def grad_balance_scores(scores: torch.Tensor, grad_balance: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """dL/ds [S, E] from dL/ds' (the Jacobian of balance_scores):
    sigmoid: ds = (ds' - sum_e s'_e ds'_e) / sum_e s_e;  softmax: ds = ds'."""
    if config.score_func == "softmax":
        return grad_balance
    total = scores.sum(-1, keepdim=True)
    return (grad_balance - (scores / total * grad_balance).sum(-1, keepdim=True)) / total


def check_mixtral_router(config, what: str) -> None:
    """Raise ValueError unless config's router options are the defaults (Mixtral's router) and it
    has no shared expert, for `what`, an export to Mixtral that has nowhere to put the others. config: MoEConfig or a
    TransformerConfig (both carry the router fields)."""
    defaults = MoEConfig(1, 1, 1, 1)
    for name in ("score_func", "router_bias", "correction_bias", "n_group", "topk_group", "renormalize_epsilon",
                 "routed_scaling_factor", "seq_aux_loss_coef"):
        if getattr(config, name) != getattr(defaults, name):
            raise ValueError(f"{what}: expected Mixtral's router ({name}={getattr(defaults, name)!r}), got "
                             f"{name}={getattr(config, name)!r}")
    if config.shared_ffn_size:  # Mixtral has no shared expert: exporting would drop it silently
        raise ValueError(f"{what}: expected no shared expert (shared_ffn_size=0, as Mixtral), got "
                         f"shared_ffn_size={config.shared_ffn_size}")


def corrected_bias(correction_bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free update: b_e + rate * sign(mean_e load_e - load_e), [E] -> [E]
    in correction_bias's dtype. load [E] is a step's tokens per expert, summed over the mesh."""
    load = load.to(torch.float64)
    return correction_bias + (rate * torch.sign(load.mean() - load)).to(correction_bias.dtype)
