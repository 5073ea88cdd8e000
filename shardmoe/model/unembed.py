"""Unembedding fused with the cross-entropy loss, with an explicit backward.

    logits[B L V] = x[B L M] . W[V M]                 (float32 for bf16/fp32, float64 for float64)
    lse[B L]      = logsumexp_V logits                (max-shifted: stable for any logit range)
    loss          = sum_{B L} (lse - logits[target]) / N      (N = token count, default B*L)
backward, given dloss (a scalar):
    dlogits = dloss (softmax(logits) - onehot(target)) / N
    dx      = dlogits . W;    dW = sum_{B L} dlogits^T x

The weight is declared 'V/t M/d'. With V split over t, lse becomes a distributed logsumexp
(max over t, then psum over t of the shifted exp-sums) and the target logit a psum over t of the
shard that owns it; dx is then unreduced over t. The logits are not saved: the backward
recomputes them from x and W, keeping the residuals at one float per token.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .residuals import check_backward_mode, compute_dtype, load_residuals, save_residuals

WEIGHT_SPEC = "V/t M/d"


class CrossEntropyResiduals(NamedTuple):
    x: Tensor        # B L M  final-norm output
    weight: Tensor   # V M
    targets: Tensor  # B L int64
    lse: Tensor      # B L    compute dtype
    num_tokens: int  # N, the loss denominator


class CrossEntropyGrads(NamedTuple):
    weight: Tensor  # V M


def unembed_logits(x: Tensor, weight: Tensor) -> Tensor:
    """logits[B L V] = x . W^T in the compute dtype (float32 unless x is float64)."""
    acc = compute_dtype(x.dtype)
    return torch.einsum("blm,vm->blv", x.to(acc), weight.to(acc))


def cross_entropy_forward(x: Tensor, weight: Tensor, targets: Tensor,
                          num_tokens: int | None = None) -> tuple[Tensor, CrossEntropyResiduals]:
    """Mean next-token loss (a 0-dim tensor in the compute dtype) of logits = x . W^T."""
    if num_tokens is None:
        num_tokens = targets.numel()
    logits = unembed_logits(x, weight)
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, targets[..., None])[..., 0]
    loss = (lse - target_logit).sum() / num_tokens
    return loss, CrossEntropyResiduals(x, weight, targets, lse, num_tokens)


def cross_entropy_backward(res: CrossEntropyResiduals, grad_loss: Tensor) -> tuple[Tensor, CrossEntropyGrads]:
    """(dx[B L M], dW[V M]) of the loss, scaled by the incoming scalar gradient."""
    logits = unembed_logits(res.x, res.weight)
    grad_logits = torch.exp(logits - res.lse[..., None])
    grad_logits.scatter_add_(-1, res.targets[..., None],
                             torch.full_like(res.lse[..., None], -1.0))
    grad_logits *= grad_loss.to(grad_logits.dtype) / res.num_tokens
    grad_x = torch.einsum("blv,vm->blm", grad_logits, res.weight.to(grad_logits.dtype))
    grad_w = torch.einsum("blv,blm->vm", grad_logits, res.x.to(grad_logits.dtype))
    return grad_x.to(res.x.dtype), CrossEntropyGrads(grad_w.to(res.weight.dtype))


class CrossEntropyFunction(torch.autograd.Function):
    """autograd.Function whose backward is cross_entropy_backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, num_tokens: int | None) -> Tensor:
        loss, res = cross_entropy_forward(x, weight, targets, num_tokens)
        save_residuals(ctx, res)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_x, grads = cross_entropy_backward(load_residuals(ctx), grad_loss)
        return grad_x, grads.weight, None, None


def unembed_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, num_tokens: int | None = None,
                          backward: str = "explicit") -> Tensor:
    """Loss of the unembedding, differentiated by the explicit backward or by plain autograd."""
    if check_backward_mode(backward) == "explicit":
        return CrossEntropyFunction.apply(x, weight, targets, num_tokens)
    return cross_entropy_forward(x, weight, targets, num_tokens)[0]


class Unembedding(nn.Module):
    """Output projection to vocab logits W[V M] ('V/t M/d') fused with the cross-entropy loss."""

    SPECS = {"weight": WEIGHT_SPEC}

    def __init__(self, vocab_size: int, d_model: int, *, init_std: float = 0.02,
                 backward: str = "explicit", dtype=None, device=None):
        super().__init__()
        self.backward = check_backward_mode(backward)
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, x: Tensor, targets: Tensor, num_tokens: int | None = None) -> Tensor:
        """Mean cross-entropy of x[B L M] against targets[B L]."""
        return unembed_cross_entropy(x, self.weight, targets, num_tokens, backward=self.backward)

    def logits(self, x: Tensor) -> Tensor:
        """logits[B L V] in the compute dtype, for evaluation and sampling."""
        return unembed_logits(x, self.weight)
