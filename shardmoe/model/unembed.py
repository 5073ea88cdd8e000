"""Unembedding fused with the cross-entropy loss, with an explicit backward.

    logits[B L V] = x[B L M] . W[V M]                 (float32 for bf16/fp32, float64 for float64)
    lse[B L]      = logsumexp_V logits  = m + log sum_V exp(logits - m),  m = max_V logits
    loss          = sum_{B L} (lse - logits[target]) / N      (N = token count, default B*L)
backward, given dloss (a scalar):
    dlogits = dloss (softmax(logits) - onehot(target)) / N
    dx      = dlogits . W;    dW = sum_{B L} dlogits^T x

Sharded (docs/model.md "Layout"): x 'B/d L M' (replicated over t), W 'V/t M/d', logits 'B/d L V/t'.
    forward:  W[V/t M] = all_gather_d(W); the logsumexp is distributed and stays stable:
              m = max over t of the local maxima (a constant shift, no gradient),
              lse = m + log psum_t(sum_{V/t} exp(logits - m)); the target logit is a psum over t
              of the block that owns it. N defaults to the global token count B L |d|, and the
              loss is psum'd over d so every rank holds the global mean.
    backward: dlogits as above on the local vocab block; dx = dlogits . W is a partial sum over t
              (the final RMSNorm sums it); dW[V/t M/d] = psum_scatter_d(dlogits^T x).
The logits are not saved: the backward recomputes them from x and W, keeping the residuals at one
float per token.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .embedding import WEIGHT_SPEC, vocab_block_ids, vocab_table
from shardmoe.parallel import dtensors
from shardmoe.parallel.shardops import all_gather, einsum_unreduced, psum, psum_scatter, unreduced

from .residuals import autograd_grads, check_backward_mode, compute_dtype, forward_autocast, load_residuals, save_residuals
from .sharding import leave_partial, pmax, size


class CrossEntropyResiduals(NamedTuple):
    x: Tensor        # B L M  final-norm output
    weight: Tensor   # V/t M/d local shard, gathered again by the backward
    targets: Tensor  # B L int64
    lse: Tensor      # B L    compute dtype
    num_tokens: int  # N, the loss denominator
    mesh: object     # shardmoe.Mesh or None


class CrossEntropyGrads(NamedTuple):
    weight: Tensor  # V/t M/d


def unembed_logits(x: Tensor, weight: Tensor, mesh=None) -> Tensor:
    """logits[B L V/t] = x . W^T in the compute dtype (float32 unless x is float64); under
    torch.autocast the GEMM runs in its dtype and the logits come back in the compute dtype, so the
    log-sum-exp and the loss stay float32."""
    acc = compute_dtype(x.dtype)
    table = all_gather(f"{WEIGHT_SPEC} -> V/t M", weight, mesh)
    return torch.einsum("blm,vm->blv", x.to(acc), table.to(acc)).to(acc)


def cross_entropy_forward(x: Tensor, weight: Tensor, targets: Tensor, num_tokens: int | None = None,
                          mesh=None) -> tuple[Tensor, CrossEntropyResiduals]:
    """Mean next-token loss (a 0-dim tensor in the compute dtype) of logits = x . W^T."""
    if num_tokens is None:
        num_tokens = targets.numel() * size(mesh, "d")
    logits = unembed_logits(x, weight, mesh)
    shift = pmax(logits.amax(dim=-1), mesh, "t")
    sum_exp = einsum_unreduced("B/d L V/t -> B/d L", torch.exp(logits - shift[..., None]))  # contracts V/t
    lse = shift + torch.log(psum("B/d L -> B/d L", sum_exp, mesh))
    local_targets, in_block = vocab_block_ids(targets, logits.shape[-1], mesh)
    # onehot(target)[B L V/t] . logits as a lookup: the block owning the target holds the term.
    target_logit = unreduced("B/d L", logits.gather(-1, local_targets[..., None])[..., 0] * in_block, "t")
    target_logit = psum("B/d L -> B/d L", target_logit, mesh)
    # The sum over this rank's tokens B/d is its term of the global loss.
    loss = unreduced("1", ((lse - target_logit).sum() / num_tokens).reshape(1), "d")
    loss = psum("1 -> 1", loss, mesh).reshape(())
    return loss, CrossEntropyResiduals(x, weight, targets, lse.detach(), num_tokens, mesh)


def cross_entropy_backward(res: CrossEntropyResiduals, grad_loss: Tensor) -> tuple[Tensor, CrossEntropyGrads]:
    """(dx[B L M], dW[V/t M/d]) of the loss, scaled by the incoming scalar gradient."""
    logits = unembed_logits(res.x, res.weight, res.mesh)
    grad_logits = torch.exp(logits - res.lse[..., None])
    local_targets, in_block = vocab_block_ids(res.targets, logits.shape[-1], res.mesh)
    grad_logits.scatter_add_(-1, local_targets[..., None], -in_block[..., None].to(grad_logits.dtype))
    grad_logits *= grad_loss.to(grad_logits.dtype) / res.num_tokens
    table = all_gather(f"{WEIGHT_SPEC} -> V/t M", res.weight, res.mesh).to(grad_logits.dtype)
    # dx contracts the vocab block V/t: partial over t, summed by the final RMSNorm (its dual).
    grad_x = einsum_unreduced("B/d L V/t, V/t M -> B/d L M", grad_logits, table).to(res.x.dtype)
    grad_w = einsum_unreduced("B/d L V/t, B/d L M -> V/t M", grad_logits, res.x.to(grad_logits.dtype))  # B/d
    grad_w = psum_scatter(f"V/t M -> {WEIGHT_SPEC}", grad_w.to(res.weight.dtype), res.mesh)
    return leave_partial(grad_x, "t"), CrossEntropyGrads(grad_w)


class CrossEntropyFunction(torch.autograd.Function):
    """autograd.Function whose backward is cross_entropy_backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, num_tokens: int | None, mesh) -> Tensor:
        loss, res = cross_entropy_forward(x, weight, targets, num_tokens, mesh)
        save_residuals(ctx, res)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        with forward_autocast(ctx):
            grad_x, grads = cross_entropy_backward(load_residuals(ctx), grad_loss)
        return autograd_grads("CrossEntropyFunction.backward", grad_x, grads.weight, None, None, None)


def unembed_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, num_tokens: int | None = None,
                          mesh=None, backward: str = "explicit") -> Tensor:
    """Loss of the unembedding, differentiated by the explicit backward or by plain autograd."""
    if check_backward_mode(backward) == "explicit":
        return CrossEntropyFunction.apply(x, weight, targets, num_tokens, mesh)
    return cross_entropy_forward(x, weight, targets, num_tokens, mesh)[0]


class Unembedding(nn.Module):
    """Output projection to vocab logits W[V M] ('V/t M/d') fused with the cross-entropy loss.

    With a mesh the parameter is a DTensor of the table whose local tensor is this rank's block
    [V/t M/d], and the input is x[B/d L M].
    """

    SPECS = {"weight": WEIGHT_SPEC}

    def __init__(self, vocab_size: int, d_model: int, *, init_std: float = 0.02, mesh=None,
                 backward: str = "explicit", dtype=None, device=None):
        super().__init__()
        self.mesh = mesh
        self.backward = check_backward_mode(backward)
        self.weight = vocab_table(vocab_size, d_model, init_std, mesh, dtype, device)

    def forward(self, x: Tensor, targets: Tensor, num_tokens: int | None = None) -> Tensor:
        """Mean cross-entropy of x[B/d L M] against targets[B/d L], over every rank's tokens."""
        return unembed_cross_entropy(x, dtensors.compute_view(self.weight), targets, num_tokens, self.mesh,
                                     backward=self.backward)

    def logits(self, x: Tensor) -> Tensor:
        """logits[B/d L V/t] in the compute dtype, for evaluation and sampling."""
        return unembed_logits(x, dtensors.compute_view(self.weight), self.mesh)
