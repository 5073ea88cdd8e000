"""Routing: gate logits, scores, selection, combine weights, capacity, balance losses,
and the gate's backward (grad_gate_gemm, stage 6 of the explicit backward).

Shapes: S tokens, H hidden, E experts, k = top_k, Q sequences, N = number of kept
(token, expert) pairs. A pair is indexed p = t * k + j (token t, its j-th choice). Dispatch
sorts the kept pairs by expert, tokens in order within an expert, giving N "rows".

Forward, per token t (computed in float32 for fp32/bf16 inputs, float64 for float64):
  logits_t = x_t Wg (+ b)                            [S, E]   (b: router_bias, learnable)
  s_t      = softmax(logits_t) or sigmoid(logits_t)  [S, E]   (score_func)
  sel_t    = selection on s_t + correction bias, group-limited   [S, k]   (below)
  a_tj     = s_t[sel_tj]                             (the uncorrected scores)
  w_tj     = c * a_tj / (sum_{i in sel_t} a_ti + eps)  (renormalize) else c * a_tj
             c = routed_scaling_factor, eps = renormalize_epsilon
  capacity EC = ceil(S / E * capacity_factor * k): an expert keeps its first EC
  pairs in token order; the others are dropped (no output, no gradient).
Top-k of the logits then a softmax over the k selected (GPT-OSS) is softmax + renormalise with
eps = 0: exp(l_j) / sum_{i in sel} exp(l_i) = p_j / sum_{i in sel} p_i, and softmax is monotonic.

The router families' pieces (G = E / n_group experts per group):

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

import dataclasses
from dataclasses import dataclass

import torch

from shardmoe import kernels
from shardmoe.moe.config import MoEConfig
from shardmoe.rows import accumulation_dtype
from shardmoe.settings import SETTINGS


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
    first (a partial selection, cheaper than the full sort), and the rows with equal neighbours among
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


def corrected_bias(correction_bias: torch.Tensor, load: torch.Tensor, rate: float,
                   centred: bool = False) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free update: b_e + u_e, u_e = rate * sign(mean_e load_e - load_e), [E] -> [E]
    in correction_bias's dtype. load [E] is a step's tokens per expert, summed over the mesh.

    centred: u_e - mean_e u_e instead (torchtitan's rule, register_moe_load_balancing_hook): the
    biases' mean stays put rather than drifting by the imbalance of signs. Selection compares
    s + b across experts, so a constant shift routes alike; the state differs. u and its mean are
    taken in correction_bias's dtype, as torchtitan's hook takes them in float32, so the update is
    the hook's to the bit."""
    load = load.to(torch.float64)
    update = (rate * torch.sign(load.mean() - load)).to(correction_bias.dtype)
    if centred:
        update = update - update.mean()
    return correction_bias + update


@dataclass
class Routing:
    """One forward's routing decisions.

    probs     [S, E] the scores s: softmax probabilities or sigmoids (accumulation dtype)
    logsumexp [S]    logsumexp of the logits (for the z loss)
    top_idx   [S, k] selected experts, int64
    top_prob  [S, k] their scores a_tj
    weight    [S, k] combine weights w_tj (accumulation dtype)
    selected_per_expert [E] pairs routed to each expert before capacity (int64)
    kept_per_expert     [E] pairs each expert keeps (int64)
    row_pair  [N]    pair index p = t*k + j of each dispatched row, sorted by expert
    z_probs   [S, E] softmax of the logits for a sigmoid router's z loss ([S, 0] otherwise:
                     softmax routers use probs)
    token_sequence    [S] sequence of each token ([S, 0] without the sequence-wise loss)
    sequence_selected [Q, E] top-k choices per sequence and expert ([0, E] without it)
    sequence_tokens   [Q] tokens per sequence ([0] without it)
    Tensors a config does not need hold no elements, so they cost nothing to save and still
    slice by token.
    """

    probs: torch.Tensor
    logsumexp: torch.Tensor
    top_idx: torch.Tensor
    top_prob: torch.Tensor
    weight: torch.Tensor
    selected_per_expert: torch.Tensor
    kept_per_expert: torch.Tensor
    row_pair: torch.Tensor
    z_probs: torch.Tensor
    token_sequence: torch.Tensor
    sequence_selected: torch.Tensor
    sequence_tokens: torch.Tensor

    @property
    def dropped_pairs(self) -> torch.Tensor:
        """The pairs capacity dropped, a 0-dim int64 tensor on the routing's device (reading it is
        the caller's host wait, not the step's)."""
        return self.selected_per_expert.sum() - self.kept_per_expert.sum()

    def rows(self, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [N], combine weight w [N]) of each dispatched row."""
        return self.row_pair // top_k, self.weight.reshape(-1)[self.row_pair]


def route(x: torch.Tensor, gate_weight: torch.Tensor, config: MoEConfig, gate_bias: torch.Tensor | None = None,
          correction_bias: torch.Tensor | None = None, token_sequence: torch.Tensor | None = None) -> Routing:
    """Routing of x [S, H] through gate_weight [H, E] (+ gate_bias [E]); no autograd graph is built.

    correction_bias [E] moves the selection only; token_sequence [S] (token_sequence_ids)
    is needed when config.seq_aux_loss_coef > 0, and then defaults to one sequence."""
    acc = accumulation_dtype(x.dtype)
    num_tokens, num_experts = x.shape[0], config.num_experts
    logits = gate_logits(x, gate_weight, acc)
    if gate_bias is not None:
        logits = logits + gate_bias.to(acc)
    logsumexp = torch.logsumexp(logits, dim=-1)
    probs = scores_from_logits(logits, logsumexp, config)
    if config.score_func == "sigmoid" and config.z_loss_coef:
        z_probs = torch.exp(logits - logsumexp[:, None])
    else:
        z_probs = probs.new_empty(num_tokens, 0)
    top_idx = select_experts(probs, config, correction_bias)
    top_prob = probs.gather(1, top_idx)
    weight = top_prob / (top_prob.sum(-1, keepdim=True) + config.renormalize_epsilon) if config.renormalize else top_prob
    if config.routed_scaling_factor != 1.0:
        weight = weight * config.routed_scaling_factor
    row_pair, selected, kept = dispatch_order(top_idx, num_experts, config.capacity(num_tokens))
    if config.seq_aux_loss_coef:
        if token_sequence is None:
            token_sequence = torch.zeros(num_tokens, dtype=torch.int64, device=x.device)
        seq_selected, seq_tokens = sequence_selections(top_idx, token_sequence, num_experts)
    else:
        token_sequence = torch.zeros(num_tokens, 0, dtype=torch.int64, device=x.device)
        seq_selected = torch.zeros(0, num_experts, dtype=torch.int64, device=x.device)
        seq_tokens = torch.zeros(0, dtype=torch.int64, device=x.device)
    return Routing(probs, logsumexp, top_idx, top_prob, weight, selected, kept, row_pair,
                   z_probs, token_sequence, seq_selected, seq_tokens)


def dispatch_order(top_idx: torch.Tensor, num_experts: int, capacity: int | None):
    """Sort the (token, expert) pairs by expert and apply the capacity.

    top_idx [S, k] -> row_pair [N] (kept pair indices, grouped by expert, token order
    within a group), selected_per_expert [E], kept_per_expert [E].
    """
    pair_expert = top_idx.reshape(-1).to(torch.int64)
    order = torch.argsort(pair_expert, stable=True)
    # a scatter rather than bincount, whose output size CUDA reads from the data (a host wait)
    selected = torch.zeros(num_experts, dtype=torch.int64, device=top_idx.device).scatter_add_(
        0, pair_expert, torch.ones_like(pair_expert))
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


def balance_loss(routing: Routing, config: MoEConfig, num_tokens: int | None = None,
                 num_sequences: int | None = None) -> torch.Tensor:
    """Weighted aux + z + sequence-wise loss (a scalar in the accumulation dtype).

    s' = balance_scores(s): the probabilities (softmax), s / sum_e s_e (sigmoid).
    aux = E * sum_e (selected_e / S) * (sum_t s'_te / S)   (Switch / Mixtral load balancing;
          selected_e counts top-k choices before capacity, as transformers does)
    z   = sum_t logsumexp(logits_t)^2 / S
    seq = (1/Q) sum_q sum_e f_qe P_qe,  f_qe = E / (k T_q) * selected_qe,  P_qe = sum_{t in q} s'_te / T_q
          (DeepSeek-V3's sequence-wise balance loss, averaged over the Q sequences of T_q tokens)
    S and Q are the rows and sequences of `routing` unless `num_tokens` / `num_sequences` say
    otherwise: a rank holding part of a batch passes the batch's S, Q and its selected counts,
    and gets its share of the batch's loss.
    """
    probs = routing.probs
    num_tokens = probs.shape[0] if num_tokens is None else num_tokens
    loss = probs.new_zeros(())
    if num_tokens == 0:
        return loss
    balance = balance_scores(probs, config) if config.aux_loss_coef or config.seq_aux_loss_coef else None
    if config.aux_loss_coef:
        fraction = routing.selected_per_expert.to(probs.dtype) / num_tokens
        loss = loss + config.aux_loss_coef * config.num_experts * (fraction * balance.sum(0)).sum() / num_tokens
    if config.z_loss_coef:
        loss = loss + config.z_loss_coef * routing.logsumexp.square().sum() / num_tokens
    num_sequences = routing.sequence_tokens.numel() if num_sequences is None else num_sequences
    if config.seq_aux_loss_coef and num_sequences:
        per_sequence = balance.new_zeros(routing.sequence_selected.shape).index_add_(0, routing.token_sequence, balance)
        length = routing.sequence_tokens.to(probs.dtype)[:, None]
        f_times_p = config.num_experts / config.top_k * routing.sequence_selected.to(probs.dtype) * per_sequence
        loss = loss + config.seq_aux_loss_coef * (f_times_p / length.square()).sum() / num_sequences
    return loss


def grad_gate_gemm(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    routing: Routing,
    grad_weight: torch.Tensor,
    grad_loss: torch.Tensor | None,
    config: MoEConfig,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stage 6: from dL/dw_tj to the gate weight, router bias and input gradients.

    grad_weight [S, k] holds dw_tj = g_t . y_j(t) (zero for dropped pairs); grad_loss is
    dL/d(balance_loss) or None. With D_t = sum_{i in sel} a_ti + eps and c the scaling factor:
      da_tj    = (c dw_tj - sum_{i in sel} w_ti dw_ti) / D_t                 (renormalize)
               = c dw_tj                                                     (otherwise)
      ds       = da scattered to the selected experts (the selection itself passes no gradient)
      ds'      = aux_coef * E * selected_e / S^2                             (aux loss)
               + seq_coef * E / (k Q) * selected_{q(t)e} / T_q(t)^2          (sequence-wise loss)
      ds      += ds'  (softmax)  or  (ds' - sum_e s'_e ds'_e) / sum_e s_e    (sigmoid: s' = s / sum s)
      dlogits  = s * (ds - sum_e s_e ds_e)  (softmax)  or  ds * s * (1 - s)  (sigmoid)
               + z_coef * 2 lse_t softmax(logits_t) / S                      (z loss)
      dWg = x^T dlogits  [H, E];   dx = dlogits Wg^T  [S, H];   db = sum_t dlogits_t  [E]
    `num_tokens` / `num_sequences` are the S / Q of the balance losses when `routing` holds a
    subset of the tokens (a tile of them, or one rank's share of a batch, as in balance_loss).
    Returns (dx, dWg, db) in the accumulation dtype, db None unless config.router_bias.
    """
    probs = routing.probs
    acc = probs.dtype
    num_tokens = probs.shape[0] if num_tokens is None else num_tokens
    num_sequences = routing.sequence_tokens.numel() if num_sequences is None else num_sequences
    grad_weight = grad_weight.to(acc)
    scale = config.routed_scaling_factor
    if config.renormalize:
        coupled = (routing.weight * grad_weight).sum(-1, keepdim=True)
        scaled = grad_weight if scale == 1.0 else scale * grad_weight
        grad_top = (scaled - coupled) / (routing.top_prob.sum(-1, keepdim=True) + config.renormalize_epsilon)
    else:
        grad_top = grad_weight if scale == 1.0 else scale * grad_weight
    grad_probs = torch.zeros_like(probs).scatter_(1, routing.top_idx, grad_top)
    grad_balance = None
    if grad_loss is not None and config.aux_loss_coef and num_tokens:
        coef = grad_loss.to(acc) * config.aux_loss_coef * config.num_experts / num_tokens**2
        grad_balance = (coef * routing.selected_per_expert.to(acc)).expand_as(probs)
    if grad_loss is not None and config.seq_aux_loss_coef and num_sequences:
        coef = grad_loss.to(acc) * config.seq_aux_loss_coef * config.num_experts / (config.top_k * num_sequences)
        sequence = routing.token_sequence
        length = routing.sequence_tokens.to(acc)[sequence, None]
        term = coef * routing.sequence_selected.to(acc)[sequence] / length.square()
        grad_balance = term if grad_balance is None else grad_balance + term
    if grad_balance is not None:
        grad_probs = grad_probs + grad_balance_scores(probs, grad_balance, config)
    if config.score_func == "softmax":
        grad_logits = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
    else:
        grad_logits = grad_probs * probs * (1 - probs)
    if grad_loss is not None and config.z_loss_coef and num_tokens:
        coef = grad_loss.to(acc) * config.z_loss_coef * 2.0 / num_tokens
        softmax = routing.probs if config.score_func == "softmax" else routing.z_probs
        grad_logits = grad_logits + coef * routing.logsumexp[:, None] * softmax
    grad_bias = grad_logits.sum(0) if config.router_bias else None
    return gate_input_grad(grad_logits, gate_weight), gate_weight_grad(x, grad_logits), grad_bias


# On CPU, MKL runs the router's two GEMMs with a narrow expert dim slowly in their plain layouts:
# x Wg with Wg [H, E] row-major and x^T dlogits (the [S, H] operand transposed) ran slower up to
# E = 10 than with the weight column-major and as (dlogits^T x)^T, and from E = 12 the plain
# layouts were as fast (docs/benchmarks.md, "The router's GEMMs in a narrow layout for E <= 8",
# measured by benchmarks/router_gemms.py). The switch sits at 8, the widths models use, short of
# the measured edge (MKL's, which another MKL or CPU may move).
NARROW_ROUTER = 8


def narrow_router(x: torch.Tensor, num_experts: int) -> bool:
    """Whether the router's GEMMs take the narrow layouts: x on CPU and E <= NARROW_ROUTER."""
    return x.device.type == "cpu" and num_experts <= NARROW_ROUTER


# On CUDA (kernels.router_path) the three products run on kernels/router_gemm.py: float32 accuracy on
# tensor cores (tf32x3) where cuBLAS's float32 GEMM with TF32 off runs on the CUDA cores, and a
# bfloat16 x read as it is, widened in registers, with no [S, H] float32 copy. Their results are
# float32, so they are taken only where float32 is the dtype asked for. CPU tensors ask the kernels
# only under the test switch shardmoe.settings force_kernels (as dispatch.select does): a CPU step
# never enters shardmoe.kernels.


def router_kernel(*tensors: torch.Tensor) -> bool:
    """Whether the router GEMM of these operands runs on kernels/router_gemm.py (kernels.router_path)."""
    return (tensors[0].device.type != "cpu" or SETTINGS.force_kernels) and kernels.router_path(*tensors)


def gate_logits(x: torch.Tensor, gate_weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x Wg: x [S, H], gate_weight [H, E] -> [S, E] in `dtype`, the inputs cast to it or, for float32,
    read as they are by the router kernel (route()); dtype None: torch in the inputs' one dtype, no
    cast (the transformers seam's RouterLogits, under autograd). Under autograd the narrow form's
    weight gradient comes out as (dlogits^T x)^T as well (torch's mm backward for a column-major
    operand)."""
    if dtype is not None:
        if dtype == torch.float32 and router_kernel(x, gate_weight):
            from shardmoe.kernels.router_gemm import router_mm

            return router_mm(x, gate_weight)
        x, gate_weight = x.to(dtype), gate_weight.to(dtype)
    if narrow_router(x, gate_weight.shape[1]):
        return x @ gate_weight.t().contiguous().t()
    return x @ gate_weight


def gate_weight_grad(x: torch.Tensor, grad_logits: torch.Tensor) -> torch.Tensor:
    """dWg = x^T dlogits: x [S, H], grad_logits [S, E] -> [H, E] contiguous in grad_logits' dtype
    (x cast to it, or read as it is by the router kernel)."""
    if grad_logits.dtype == torch.float32 and router_kernel(x, grad_logits):
        from shardmoe.kernels.router_gemm import router_mm

        return router_mm(x.t(), grad_logits)
    x = x.to(grad_logits.dtype)
    if narrow_router(x, grad_logits.shape[1]):
        return (grad_logits.t() @ x).t().contiguous()
    return x.t() @ grad_logits


def gate_input_grad(grad_logits: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """dx = dlogits Wg^T: grad_logits [S, E], gate_weight [H, E] -> [S, H] in grad_logits' dtype
    (gate_weight cast to it, or read as it is, through its transpose's strides, by the router kernel)."""
    if grad_logits.dtype == torch.float32 and router_kernel(grad_logits, gate_weight):
        from shardmoe.kernels.router_gemm import router_mm

        return router_mm(grad_logits, gate_weight.t())
    return grad_logits @ gate_weight.to(grad_logits.dtype).t()


class GateRouter:
    """The layer's own router, as the MoE Function takes it: router tensors (gate_weight [H, E],
    gate_bias [E] or None, correction_bias [E] or None, token_sequence [S] or None); the last two
    steer selection and the sequence-wise loss and get no gradient. Backward is stage 6."""

    num_tensors = 4

    def __init__(self, config: MoEConfig):
        self.config = config

    def routing_inputs(self, tensors: tuple) -> dict:
        """The Routing fields route() takes as they are from the router tensors: token_sequence,
        when the sequence-wise loss is on and the caller gave one."""
        return {"token_sequence": tensors[3]} if self.config.seq_aux_loss_coef and tensors[3] is not None else {}

    def route(self, x: torch.Tensor, tensors: tuple, dropless: bool) -> Routing:
        gate_weight, gate_bias, correction_bias, token_sequence = tensors
        config = dataclasses.replace(self.config, capacity_factor=None) if dropless else self.config
        return route(x, gate_weight, config, gate_bias, correction_bias, token_sequence)

    def loss(self, routing: Routing, num_tokens: int | None, num_sequences: int | None) -> torch.Tensor:
        return balance_loss(routing, self.config, num_tokens, num_sequences)

    def fake_routing(self, x: torch.Tensor, tensors: tuple, num_rows) -> Routing:
        """A Routing of uninitialised tensors of route()'s shapes and dtypes, for N = num_rows kept
        pairs (torch.compile's fake tensors). The per-sequence counts are left empty: they are
        recounted in backward, not saved (function.SavedForBackward)."""
        c, acc = self.config, accumulation_dtype(x.dtype)
        S, E, k = x.shape[0], c.num_experts, c.top_k
        ints = dict(dtype=torch.int64, device=x.device)
        return Routing(probs=x.new_empty(S, E, dtype=acc), logsumexp=x.new_empty(S, dtype=acc),
                       top_idx=x.new_empty(S, k, **ints), top_prob=x.new_empty(S, k, dtype=acc),
                       weight=x.new_empty(S, k, dtype=acc), selected_per_expert=x.new_empty(E, **ints),
                       kept_per_expert=x.new_empty(E, **ints), row_pair=x.new_empty(num_rows, **ints),
                       z_probs=x.new_empty(S, E if c.score_func == "sigmoid" and c.z_loss_coef else 0, dtype=acc),
                       token_sequence=x.new_empty(S, **ints) if c.seq_aux_loss_coef else x.new_empty(S, 0, **ints),
                       sequence_selected=x.new_empty(0, E, **ints), sequence_tokens=x.new_empty(0, **ints))

    def backward(self, x: torch.Tensor, tensors: tuple, routing: Routing, grad_weight: torch.Tensor,
                 grad_loss: torch.Tensor | None, num_tokens: int | None, num_sequences: int | None):
        """(dx [S, H] acc dtype, gradients of the four router tensors) from dL/dw [S, k]."""
        gate_weight, gate_bias = tensors[:2]
        grad_x, grad_gate, grad_bias = grad_gate_gemm(x, gate_weight, routing, grad_weight, grad_loss, self.config,
                                                      num_tokens, num_sequences)
        grad_bias = None if gate_bias is None else grad_bias.to(gate_bias.dtype)
        return grad_x, (grad_gate.to(gate_weight.dtype), grad_bias, None, None)


class GivenRouting:
    """A routing made outside the layer (transformers' experts seam: the family's own router ran):
    router tensors (top_k_index [S, k] int, top_k_weights [S, k]). Every pair is kept (no capacity);
    the Function's gradient for top_k_weights is the gate dots dL/dw_tj = g_t . y_j(x_t), through
    which the family's router gets its own; there is no balance loss here (the family adds its own)."""

    num_tensors = 2

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def routing_inputs(self, tensors: tuple) -> dict:
        """The Routing fields that are the given tensors themselves."""
        top_k_index, top_k_weights = tensors
        return {"top_idx": top_k_index, "top_prob": top_k_weights, "weight": top_k_weights}

    def route(self, x: torch.Tensor, tensors: tuple, dropless: bool) -> Routing:
        top_k_index, top_k_weights = tensors
        if top_k_index.numel() and top_k_index.device.type == "cpu":
            low, high = int(top_k_index.min()), int(top_k_index.max())
            if low < 0 or high >= self.num_experts:
                raise ValueError(f"top_k_index: expected expert ids in 0..{self.num_experts - 1}, got {low}..{high}")
        elif top_k_index.numel():
            # reading the ids on the host would wait for the GPU in every layer of every step: the
            # device checks them in stream order, before dispatch uses them, as torch's own indexing
            # does on CUDA (a device-side assert naming top_k_index)
            torch._assert_async(((top_k_index >= 0) & (top_k_index < self.num_experts)).all(),
                                f"top_k_index: expected expert ids in 0..{self.num_experts - 1}")
        row_pair, selected, kept = dispatch_order(top_k_index, self.num_experts, None)
        S, device = x.shape[0], x.device
        none = torch.zeros(S, 0, dtype=accumulation_dtype(x.dtype), device=device)
        return Routing(probs=none, logsumexp=none.new_zeros(0), top_idx=top_k_index, top_prob=top_k_weights,
                       weight=top_k_weights, selected_per_expert=selected, kept_per_expert=kept, row_pair=row_pair,
                       z_probs=none, token_sequence=torch.zeros(S, 0, dtype=torch.int64, device=device),
                       sequence_selected=torch.zeros(0, self.num_experts, dtype=torch.int64, device=device),
                       sequence_tokens=torch.zeros(0, dtype=torch.int64, device=device))

    def loss(self, routing: Routing, num_tokens: int | None, num_sequences: int | None) -> torch.Tensor:
        return routing.probs.new_zeros(())

    def fake_routing(self, x: torch.Tensor, tensors: tuple, num_rows) -> Routing:
        top_k_index, top_k_weights = tensors
        S, E, acc = x.shape[0], self.num_experts, accumulation_dtype(x.dtype)
        ints = dict(dtype=torch.int64, device=x.device)
        return Routing(probs=x.new_empty(S, 0, dtype=acc), logsumexp=x.new_empty(0, dtype=acc),
                       top_idx=torch.empty_like(top_k_index), top_prob=torch.empty_like(top_k_weights),
                       weight=torch.empty_like(top_k_weights), selected_per_expert=x.new_empty(E, **ints),
                       kept_per_expert=x.new_empty(E, **ints), row_pair=x.new_empty(num_rows, **ints),
                       z_probs=x.new_empty(S, 0, dtype=acc), token_sequence=x.new_empty(S, 0, **ints),
                       sequence_selected=x.new_empty(0, E, **ints), sequence_tokens=x.new_empty(0, **ints))

    def backward(self, x, tensors, routing, grad_weight, grad_loss, num_tokens, num_sequences):
        return None, (None, grad_weight.to(routing.weight.dtype))
