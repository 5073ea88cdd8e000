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

Scores, softmax and their gradients run in float32 for bf16/fp32 (float64 for float64); P is cast
to the activation dtype before it meets v. Neither P nor the mask is saved: the backward rebuilds
the mask from the segment ids and P from q, k and lse (a [B K Q L] float), so the saved residuals
grow linearly in L.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
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


class AttentionResiduals(NamedTuple):
    nx: Tensor           # B L M   attention input (normed residual stream)
    w_q: Tensor          # M/d Q K/t D   local shards, gathered again by the backward
    w_kv: Tensor         # 2 M/d K/t D
    w_o: Tensor          # M/d Q K/t D
    q: Tensor            # B L Q K D  after RoPE
    k: Tensor            # B L K D    after RoPE
    v: Tensor            # B L K D
    o: Tensor            # B L Q K D  softmax-weighted values, input of w_o
    lse: Tensor          # B K Q L    logsumexp of the masked scores, compute dtype
    segment_ids: Tensor  # B L        rebuilds the mask
    rope_cos: Tensor     # B L D/2
    rope_sin: Tensor     # B L D/2
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


def _masked_scores(q: Tensor, k: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """S[B K Q i j] = scale q . k in the compute dtype, -inf where the mask forbids."""
    acc = compute_dtype(q.dtype)
    scores = torch.einsum("biqkd,bjkd->bkqij", q.to(acc), k.to(acc)) * scale
    return scores.masked_fill(~allowed[:, None, None], float("-inf"))


def attention_forward(nx: Tensor, w_q: Tensor, w_kv: Tensor, w_o: Tensor, segment_ids: Tensor,
                      rope: RopeTable, mesh=None) -> tuple[Tensor, AttentionResiduals]:
    """out[B L M] of GQA over packed segments; see the module docstring for the formulas."""
    shards = (w_q, w_kv, w_o)
    w_q, w_kv, w_o = _gather_weights(w_q, w_kv, w_o, mesh)
    scale = 1.0 / math.sqrt(w_q.shape[-1])
    q, _ = rope_forward(torch.einsum("blm,mqkd->blqkd", nx, w_q), rope)
    k, v = torch.einsum("blm,cmkd->cblkd", nx, w_kv).unbind(0)
    k, _ = rope_forward(k, rope)
    scores = _masked_scores(q, k, attention_mask(segment_ids), scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    o = torch.einsum("bkqij,bjkd->biqkd", probs.to(v.dtype), v)
    out = einsum_unreduced("B/d L Q K/t D, M Q K/t D -> B/d L M", o, w_o)  # contracts K/t
    out = psum_scatter("B/d L M -> B/d L M/t", out, mesh)
    return out, AttentionResiduals(nx, *shards, q, k, v, o, lse, segment_ids, rope.cos, rope.sin, scale, mesh)


def attention_backward(res: AttentionResiduals, grad_out: Tensor) -> tuple[Tensor, AttentionGrads]:
    """(dnx[B L M], grads of w_q, w_kv, w_o) given dout[B L M]; see the module docstring."""
    acc = res.lse.dtype
    w_q, w_kv, w_o = _gather_weights(res.w_q, res.w_kv, res.w_o, res.mesh)
    grad_out = all_gather("B/d L M/t -> B/d L M", grad_out, res.mesh)
    grad_o = torch.einsum("blm,mqkd->blqkd", grad_out, w_o)
    grad_w_o = einsum_unreduced("B/d L Q K/t D, B/d L M -> M Q K/t D", res.o, grad_out)  # contracts B/d

    scores = _masked_scores(res.q, res.k, attention_mask(res.segment_ids), res.scale)
    probs = torch.exp(scores - res.lse[..., None])
    grad_probs = torch.einsum("biqkd,bjkd->bkqij", grad_o.to(acc), res.v.to(acc))
    grad_v = torch.einsum("bkqij,biqkd->bjkd", probs.to(res.v.dtype), grad_o)
    grad_scores = probs * (grad_probs - (probs * grad_probs).sum(dim=-1, keepdim=True)) * res.scale

    rope = RopeResiduals(res.rope_cos, res.rope_sin)
    grad_q_rot = torch.einsum("bkqij,bjkd->biqkd", grad_scores, res.k.to(acc)).to(res.q.dtype)
    grad_k_rot = torch.einsum("bkqij,biqkd->bjkd", grad_scores, res.q.to(acc)).to(res.k.dtype)
    grad_q, _ = rope_backward(rope, grad_q_rot)
    grad_k, _ = rope_backward(rope, grad_k_rot)
    grad_kv = torch.stack([grad_k, grad_v])

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
    def forward(ctx, nx, w_q, w_kv, w_o, segment_ids, rope_cos, rope_sin, mesh):
        out, res = attention_forward(nx, w_q, w_kv, w_o, segment_ids, RopeTable(rope_cos, rope_sin), mesh)
        save_residuals(ctx, res)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with forward_autocast(ctx):
            grad_nx, grads = attention_backward(load_residuals(ctx), grad_out)
        return autograd_grads("AttentionFunction.backward", grad_nx, *grads, None, None, None, None)


def attention(nx: Tensor, w_q: Tensor, w_kv: Tensor, w_o: Tensor, segment_ids: Tensor, rope: RopeTable,
              mesh=None, backward: str = "explicit") -> Tensor:
    """GQA attention, differentiated by the explicit backward or by plain autograd."""
    if check_backward_mode(backward) == "explicit":
        return AttentionFunction.apply(nx, w_q, w_kv, w_o, segment_ids, rope.cos, rope.sin, mesh)
    return attention_forward(nx, w_q, w_kv, w_o, segment_ids, rope, mesh)[0]


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

    def forward(self, nx: Tensor, segment_ids: Tensor, rope: RopeTable) -> Tensor:
        """nx[B/d L M] -> out[B/d L M/t]; segment_ids and rope come from packed_layout / rope_table."""
        w_q, w_kv, w_o = (dtensors.compute_view(w) for w in (self.w_q, self.w_kv, self.w_o))
        return attention(nx, w_q, w_kv, w_o, segment_ids, rope, self.mesh, backward=self.backward)
