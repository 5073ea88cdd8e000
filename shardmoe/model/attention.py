"""Grouped-query attention with RoPE, packed-sequence masks and an explicit backward.

Axes: B batch, L tokens (i = query, j = key), M d_model, K kv heads, Q query heads per kv head,
D head dim. Weights (seqax layout, docs/model.md "Layout"):
    w_q  'M/d Q K/t D'    w_kv '2 M/d K/t D' (k then v)    w_o 'M/d Q K/t D'
Forward, with s = D^(-1/2) and allowed(i, j) = j <= i and segment(i) == segment(j):
    q[B L Q K D]    = RoPE(nx[B L M] . w_q[M Q K D])
    k, v[B L K D]   = RoPE(nx . w_kv[0]), nx . w_kv[1]
    S[B K Q i j]    = s q[B i Q K D] . k[B j K D]        (masked to -inf where not allowed)
    lse[B K Q i]    = logsumexp_j S;   P = exp(S - lse)
    o[B i Q K D]    = P . v[B j K D]
    out[B L M]      = o[B L Q K D] . w_o[M Q K D]        (contracts K/t: unreduced over t)
Backward, given dout[B L M]:
    do  = dout . w_o;                     dw_o  = sum_{B L} o dout
    dP  = do . v;   dv = sum_{Q i} P do
    dS  = P (dP - sum_j P dP)             (zero where masked, as P is)
    dq  = RoPE^T(s dS . k);   dk = RoPE^T(s sum_{Q i} dS q)
    dnx = dq . w_q + dk . w_kv[0] + dv . w_kv[1]          (unreduced over t)
    dw_q = sum_{B L} nx dq;   dw_kv = sum_{B L} nx [dk, dv]
Sharded (docs/model.md "Layout"): nx 'B/d L M' (replicated over t), out 'B/d L M/t'; each t rank
owns K/t kv heads and their Q query heads. Forward gathers the weights over d, runs the formulas
on the local heads and finishes with out[B/d L M/t] = psum_scatter_t(out). Backward gathers dout
over t and the weights over d again (FSDP keeps only shards between the passes), returns dnx as a
partial sum over t (the RMSNorm before it sums it) and dw = psum_scatter_d(dw) for each weight.

The core (S, P, o and their gradients) runs one of two ways (CORES):
  fused      torch's scaled_dot_product_attention with the mask as an additive bias[B 1 L L] (0 or
             -inf, attention_bias) in the activations' dtype: its fused kernels (the CPU flash
             kernel; CUDA's memory-efficient one, which takes a bias) never form S or P, so the core
             keeps O(L) per head (o and the logsumexp). The model makes the bias once per forward
             (Transformer.context) and every layer's kernel saves that one tensor.
             The explicit backward runs the kernel's own fused backward through the local autograd
             graph the forward built over detached q, k, v (its output is saved with that graph):
             dq, dk, dv of the same formulas, with no [B K Q L L] tensor.
  reference  the formulas above written out: S, P in float32 for bf16/fp32 (float64 for float64),
             P cast to the activation dtype before it meets v. Neither P nor the mask is saved:
             the backward rebuilds the mask from the segment ids and P from q, k and lse. It is
             the path float64 runs (default_core) and the one the fused path is checked against.
Decoding with a KV cache (attention_decode) runs the new tokens' queries over the cached keys and
values (KVCache): the cost of one new token is linear in the tokens before it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmoe.parallel import dtensors
from shardmoe.parallel.shardops import all_gather, einsum_unreduced, psum_scatter

from .residuals import autograd_grads, check_backward_mode, compute_dtype, forward_autocast, load_residuals, save_residuals
from .rope import RopeResiduals, RopeTable, rope_backward, rope_forward
from .segments import attention_mask
from .sharding import leave_partial, local_shape

W_Q_SPEC = "M/d Q K/t D"
W_KV_SPEC = "2 M/d K/t D"
W_O_SPEC = "M/d Q K/t D"
CORES = ("fused", "reference")


def default_core(dtype: torch.dtype) -> str:
    """The core a forward in `dtype` runs: the reference's exact float64 for float64, else fused."""
    return "reference" if dtype == torch.float64 else "fused"


def check_core(core: str) -> str:
    if core not in CORES:
        raise ValueError(f"core: expected one of {', '.join(CORES)}, got {core!r}")
    return core


class AttentionResiduals(NamedTuple):
    nx: Tensor           # B L M   attention input (normed residual stream)
    w_q: Tensor          # M/d Q K/t D   local shards, gathered again by the backward
    w_kv: Tensor         # 2 M/d K/t D
    w_o: Tensor          # M/d Q K/t D
    o: Tensor            # B L Q K D  softmax-weighted values, input of w_o
    rope_cos: Tensor     # B L D/2
    rope_sin: Tensor     # B L D/2
    q: Tensor            # B L Q K D  after RoPE (the fused core: the leaves of its graph)
    k: Tensor            # B L K D    after RoPE
    v: Tensor            # B L K D
    lse: Tensor | None   # B K Q L    the reference core: logsumexp of the masked scores, compute dtype
    segment_ids: Tensor | None  # B L  the reference core: rebuilds the mask
    fused_o: Tensor | None      # B L Q K D  the fused core: o with the kernel's grad_fn over q, k, v
    scale: float
    mesh: object         # shardmoe.Mesh or None


class AttentionGrads(NamedTuple):
    w_q: Tensor   # M/d Q K/t D
    w_kv: Tensor  # 2 M/d K/t D
    w_o: Tensor   # M/d Q K/t D


def _gather_weights(w_q: Tensor, w_kv: Tensor, w_o: Tensor, mesh) -> tuple[Tensor, Tensor, Tensor]:
    return (all_gather(f"{W_Q_SPEC} -> M Q K/t D", w_q, mesh),
            all_gather(f"{W_KV_SPEC} -> 2 M K/t D", w_kv, mesh),
            all_gather(f"{W_O_SPEC} -> M Q K/t D", w_o, mesh))


def _project(nx: Tensor, w_q: Tensor, w_kv: Tensor, rope: RopeTable) -> tuple[Tensor, Tensor, Tensor]:
    """q[B L Q K D], k[B L K D] after RoPE and v[B L K D] of nx[B L M] (gathered weights)."""
    q, _ = rope_forward(torch.einsum("blm,mqkd->blqkd", nx, w_q), rope)
    k, v = torch.einsum("blm,cmkd->cblkd", nx, w_kv).unbind(0)
    k, _ = rope_forward(k, rope)
    return q, k, v


def _output(o: Tensor, w_o: Tensor, mesh) -> Tensor:
    """out[B/d L M/t] = psum_scatter_t(o . w_o), which contracts K/t."""
    out = einsum_unreduced("B/d L Q K/t D, M Q K/t D -> B/d L M", o, w_o)
    return psum_scatter("B/d L M -> B/d L M/t", out, mesh)


def _masked_scores(q: Tensor, k: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """S[B K Q i j] = scale q . k in the compute dtype, -inf where the mask forbids."""
    acc = compute_dtype(q.dtype)
    scores = torch.einsum("biqkd,bjkd->bkqij", q.to(acc), k.to(acc)) * scale
    return scores.masked_fill(~allowed[:, None, None], float("-inf"))


def reference_core(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(o[B L Q K D], lse[B K Q L]) of the formulas, S and P formed in the compute dtype; allowed[B Lq Lk]."""
    scores = _masked_scores(q, k, allowed, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("bkqij,bjkd->biqkd", probs.to(v.dtype), v), lse


def attention_bias(segment_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """bias[B 1 L L] of the fused core: 0 where attention_mask allows, -inf elsewhere, in `dtype`
    (the activations': the kernels add it to the scores)."""
    allowed = attention_mask(segment_ids)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def fused_core(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """o[B L Q K D] by torch's scaled_dot_product_attention (differentiable by its fused backward);
    bias[B 1 Lq Lk] additive in q's dtype, or a bool mask (allowed). Query head h = k Q + q of the
    kernel's [B (K Q) L D] layout reads kv head h // Q: k and v are repeated Q times to that layout
    (a copy of q's size; their gradients sum back over the Q), which every fused kernel takes (CUDA's
    memory-efficient one has no grouped-query form)."""
    batch, length, per_kv, kv_heads, head_dim = q.shape
    heads = q.permute(0, 3, 2, 1, 4).reshape(batch, kv_heads * per_kv, length, head_dim)
    keys, values = (t.transpose(1, 2).repeat_interleave(per_kv, dim=1) for t in (k, v))
    if bias.dtype not in (torch.bool, q.dtype):  # another autocast state than the one it was made for
        bias = bias.to(q.dtype)
    o = F.scaled_dot_product_attention(heads, keys, values, attn_mask=bias, scale=scale)
    return o.view(batch, kv_heads, per_kv, length, head_dim).permute(0, 3, 2, 1, 4)


def attention_forward(nx: Tensor, w_q: Tensor, w_kv: Tensor, w_o: Tensor, segment_ids: Tensor,
                      rope: RopeTable, mesh=None, *, core: str | None = None, bias: Tensor | None = None,
                      for_backward: bool = False) -> tuple[Tensor, AttentionResiduals]:
    """out[B L M] of GQA over packed segments; see the module docstring for the formulas. core:
    CORES (default: default_core of nx's dtype); the fused core takes `bias` (attention_bias of
    segment_ids, made here when None). Its residuals hold its graph for attention_backward only
    when `for_backward` (otherwise out is differentiable by autograd)."""
    shards = (w_q, w_kv, w_o)
    w_q, w_kv, w_o = _gather_weights(w_q, w_kv, w_o, mesh)
    scale = 1.0 / math.sqrt(w_q.shape[-1])
    q, k, v = _project(nx, w_q, w_kv, rope)
    core = check_core(default_core(nx.dtype) if core is None else core)
    if core == "reference":
        o, lse = reference_core(q, k, v, attention_mask(segment_ids), scale)
        res = (q, k, v, lse, segment_ids, None)
    else:
        bias = attention_bias(segment_ids, q.dtype) if bias is None else bias
        if for_backward:  # the kernel's autograd graph over leaves sharing q, k, v's memory
            with torch.enable_grad():
                q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                fused_o = fused_core(q, k, v, bias, scale)
            o, res = fused_o.detach(), (q, k, v, None, None, fused_o)
        else:
            o = fused_core(q, k, v, bias, scale)
            res = (q, k, v, None, None, None)
    out = _output(o, w_o, mesh)
    return out, AttentionResiduals(nx, *shards, o, rope.cos, rope.sin, *res, scale, mesh)


def _reference_core_backward(res: AttentionResiduals, grad_o: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the reference core: P rebuilt from q, k and lse, the formulas above."""
    acc = res.lse.dtype
    scores = _masked_scores(res.q, res.k, attention_mask(res.segment_ids), res.scale)
    probs = torch.exp(scores - res.lse[..., None])
    grad_probs = torch.einsum("biqkd,bjkd->bkqij", grad_o.to(acc), res.v.to(acc))
    grad_v = torch.einsum("bkqij,biqkd->bjkd", probs.to(res.v.dtype), grad_o)
    grad_scores = probs * (grad_probs - (probs * grad_probs).sum(dim=-1, keepdim=True)) * res.scale
    grad_q = torch.einsum("bkqij,bjkd->biqkd", grad_scores, res.k.to(acc)).to(res.q.dtype)
    grad_k = torch.einsum("bkqij,biqkd->bjkd", grad_scores, res.q.to(acc)).to(res.k.dtype)
    return grad_q, grad_k, grad_v


def attention_backward(res: AttentionResiduals, grad_out: Tensor) -> tuple[Tensor, AttentionGrads]:
    """(dnx[B L M], grads of w_q, w_kv, w_o) given dout[B L M]; see the module docstring."""
    w_q, w_kv, w_o = _gather_weights(res.w_q, res.w_kv, res.w_o, res.mesh)
    grad_out = all_gather("B/d L M/t -> B/d L M", grad_out, res.mesh)
    grad_o = torch.einsum("blm,mqkd->blqkd", grad_out, w_o)
    grad_w_o = einsum_unreduced("B/d L Q K/t D, B/d L M -> M Q K/t D", res.o, grad_out)  # contracts B/d

    if res.fused_o is not None:
        # the kernel's fused backward; the graph lives as long as these residuals (a retained
        # outer graph may run this backward again)
        with torch.enable_grad():
            grad_q_rot, grad_k_rot, grad_v = torch.autograd.grad(res.fused_o, (res.q, res.k, res.v),
                                                                 grad_o.to(res.o.dtype), retain_graph=True)
    elif res.lse is not None:
        grad_q_rot, grad_k_rot, grad_v = _reference_core_backward(res, grad_o)
    else:
        raise ValueError("attention_backward: the fused core's residuals hold no graph: run attention_forward "
                         "with for_backward=True")
    rope = RopeResiduals(res.rope_cos, res.rope_sin)
    grad_q, _ = rope_backward(rope, grad_q_rot)
    grad_k, _ = rope_backward(rope, grad_k_rot)
    grad_kv = torch.stack([grad_k, grad_v.to(grad_k.dtype)])

    # dnx contracts the local heads K/t: partial over t, summed by the RMSNorm before (its dual).
    grad_nx = (einsum_unreduced("B/d L Q K/t D, M Q K/t D -> B/d L M", grad_q, w_q)
               + einsum_unreduced("2 B/d L K/t D, 2 M K/t D -> B/d L M", grad_kv, w_kv))
    grad_w_q = einsum_unreduced("B/d L M, B/d L Q K/t D -> M Q K/t D", res.nx, grad_q)  # contracts B/d
    grad_w_kv = einsum_unreduced("B/d L M, 2 B/d L K/t D -> 2 M K/t D", res.nx, grad_kv)
    grads = AttentionGrads(psum_scatter(f"M Q K/t D -> {W_Q_SPEC}", grad_w_q, res.mesh),
                           psum_scatter(f"2 M K/t D -> {W_KV_SPEC}", grad_w_kv, res.mesh),
                           psum_scatter(f"M Q K/t D -> {W_O_SPEC}", grad_w_o, res.mesh))
    return leave_partial(grad_nx, "t"), grads


class AttentionFunction(torch.autograd.Function):
    """autograd.Function whose backward is attention_backward."""

    @staticmethod
    def forward(ctx, nx, w_q, w_kv, w_o, segment_ids, rope_cos, rope_sin, mesh, core, bias, for_backward):
        out, res = attention_forward(nx, w_q, w_kv, w_o, segment_ids, RopeTable(rope_cos, rope_sin), mesh, core=core,
                                     bias=bias, for_backward=for_backward)
        save_residuals(ctx, res)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with forward_autocast(ctx):
            grad_nx, grads = attention_backward(load_residuals(ctx), grad_out)
        return autograd_grads("AttentionFunction.backward", grad_nx, *grads, *(None,) * 7)


def attention(nx: Tensor, w_q: Tensor, w_kv: Tensor, w_o: Tensor, segment_ids: Tensor, rope: RopeTable,
              mesh=None, backward: str = "explicit", core: str | None = None, bias: Tensor | None = None) -> Tensor:
    """GQA attention, differentiated by the explicit backward or by plain autograd (attention_forward's
    core and bias)."""
    if check_backward_mode(backward) == "explicit":
        # the fused core's graph only when a backward will run (not under no_grad, e.g. a checkpointed forward)
        for_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (nx, w_q, w_kv, w_o))
        return AttentionFunction.apply(nx, w_q, w_kv, w_o, segment_ids, rope.cos, rope.sin, mesh, core, bias,
                                       for_backward)
    return attention_forward(nx, w_q, w_kv, w_o, segment_ids, rope, mesh, core=core, bias=bias)[0]


class KVCache:
    """One attention layer's keys (after RoPE) and values of the tokens decoded so far: k, v
    [B T K/t D] in buffers of `capacity` tokens, filled in order."""

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v[B n K D] after the cached tokens; returns every cached token's [B T+n K D]."""
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache: expected at most {self.capacity} tokens, got {end}")
        if self.k is None:
            self.k = k.new_empty(k.shape[0], self.capacity, *k.shape[2:])
            self.v = v.new_empty(v.shape[0], self.capacity, *v.shape[2:])
        self.k[:, self.length:end] = k
        self.v[:, self.length:end] = v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


@torch.no_grad()
def attention_decode(nx: Tensor, w_q: Tensor, w_kv: Tensor, w_o: Tensor, rope: RopeTable, cache: KVCache,
                     mesh=None) -> Tensor:
    """out[B n M/t] of n new tokens nx[B n M] of one document after the cache's T tokens (rope: the
    new tokens' positions T..T+n-1): query i sees keys j <= T + i. Appends their k, v to the cache."""
    w_q, w_kv, w_o = _gather_weights(w_q, w_kv, w_o, mesh)
    q, k, v = _project(nx, w_q, w_kv, rope)
    start = cache.length
    k, v = cache.append(k, v)
    new, total = q.shape[1], k.shape[1]
    allowed = (torch.arange(total, device=q.device) <= start + torch.arange(new, device=q.device)[:, None])
    allowed = allowed.expand(q.shape[0], new, total)
    scale = 1.0 / math.sqrt(w_q.shape[-1])
    if default_core(nx.dtype) == "fused":
        o = fused_core(q, k, v, allowed[:, None], scale)
    else:
        o, _ = reference_core(q, k, v, allowed, scale)
    return _output(o, w_o, mesh)


class Attention(nn.Module):
    """GQA attention block (projections, RoPE, masked softmax, output projection).

    n_q_heads = Q * K query heads over K = n_kv_heads key/value heads. Weights are initialised
    N(0, init_std^2); pass a smaller out_init_std to damp the residual branch of deep models.
    With a mesh the parameters are DTensors of the whole weights whose local tensors are this
    rank's blocks (kv heads over t, d_model over d; parallel/dtensors.py parameter).
    """

    SPECS = {"w_q": W_Q_SPEC, "w_kv": W_KV_SPEC, "w_o": W_O_SPEC}

    def __init__(self, d_model: int, n_q_heads: int, n_kv_heads: int, head_dim: int, *,
                 init_std: float = 0.02, out_init_std: float | None = None, mesh=None,
                 backward: str = "explicit", dtype=None, device=None):
        super().__init__()
        if n_q_heads % n_kv_heads:
            raise ValueError(f"n_q_heads: expected a multiple of n_kv_heads={n_kv_heads}, got {n_q_heads}")
        self.mesh = mesh
        self.backward = check_backward_mode(backward)
        q_shape = (d_model, n_q_heads // n_kv_heads, n_kv_heads, head_dim)
        factory = dict(dtype=dtype, device=device)
        w_q = torch.empty(local_shape(W_Q_SPEC, q_shape, mesh), **factory).normal_(std=init_std)
        w_kv = torch.empty(local_shape(W_KV_SPEC, (2, d_model, n_kv_heads, head_dim), mesh), **factory)
        w_o = torch.empty(local_shape(W_O_SPEC, q_shape, mesh), **factory)
        w_kv.normal_(std=init_std)
        w_o.normal_(std=init_std if out_init_std is None else out_init_std)
        self.w_q = nn.Parameter(dtensors.parameter(W_Q_SPEC, w_q, mesh))
        self.w_kv = nn.Parameter(dtensors.parameter(W_KV_SPEC, w_kv, mesh))
        self.w_o = nn.Parameter(dtensors.parameter(W_O_SPEC, w_o, mesh))

    def forward(self, nx: Tensor, segment_ids: Tensor, rope: RopeTable, bias: Tensor | None = None) -> Tensor:
        """nx[B/d L M] -> out[B/d L M/t]; segment_ids and rope come from packed_layout / rope_table,
        bias (the fused core's, made from segment_ids when None) from attention_bias."""
        return attention(nx, *self._weights(), segment_ids, rope, self.mesh, backward=self.backward, bias=bias)

    def decode(self, nx: Tensor, rope: RopeTable, cache: KVCache) -> Tensor:
        """nx[B n M] of new tokens after the cache's -> out[B n M/t] (attention_decode)."""
        return attention_decode(nx, *self._weights(), rope, cache, self.mesh)

    def _weights(self) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(dtensors.compute_view(w) for w in (self.w_q, self.w_kv, self.w_o))
