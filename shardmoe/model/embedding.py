"""Token embedding with an explicit backward.

    forward:  x[B L M] = sum_V onehot(ids)[B L V] W[V M]        (a row lookup)
    backward: dW[V M]  = sum_{B L} onehot(ids)[B L V] dx[B L M] (index-add of dx into the id's row)

The weight is declared 'V/t M/d': vocab rows split over the tensor axis t, d_model over the FSDP
axis d. The math is written for one vocab shard holding rows [vocab_start, vocab_start + V_local):
ids outside the shard look up zeros and get no gradient, so summing the shards' outputs over t
(psum_scatter 'B/d L M -> B/d L M/t') gives the full lookup. Single-process: vocab_start = 0.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .residuals import check_backward_mode, compute_dtype, load_residuals, save_residuals

WEIGHT_SPEC = "V/t M/d"


class EmbeddingResiduals(NamedTuple):
    local_ids: Tensor   # B L int64: id - vocab_start, clamped into the shard
    in_shard: Tensor    # B L bool: the id belongs to this vocab shard
    weight_shape: tuple[int, int]
    weight_dtype: torch.dtype


class EmbeddingGrads(NamedTuple):
    weight: Tensor  # V M


def embedding_forward(ids: Tensor, weight: Tensor, vocab_start: int = 0) -> tuple[Tensor, EmbeddingResiduals]:
    """x[B L M] = W[ids - vocab_start] for ids in this shard, 0 elsewhere."""
    local = ids - vocab_start
    in_shard = (local >= 0) & (local < weight.shape[0])
    local = torch.where(in_shard, local, 0)
    x = weight[local] * in_shard[..., None].to(weight.dtype)
    return x, EmbeddingResiduals(local, in_shard, tuple(weight.shape), weight.dtype)


def embedding_backward(res: EmbeddingResiduals, grad_x: Tensor) -> tuple[None, EmbeddingGrads]:
    """dW[V M] = index_add over tokens of dx[B L M]; ids have no gradient (returned as None)."""
    acc = compute_dtype(res.weight_dtype)  # accumulate repeated ids in float32 for bf16
    rows = grad_x.to(acc) * res.in_shard[..., None].to(acc)
    grad_w = torch.zeros(res.weight_shape, dtype=acc, device=grad_x.device)
    grad_w.index_add_(0, res.local_ids.reshape(-1), rows.reshape(-1, res.weight_shape[1]))
    return None, EmbeddingGrads(grad_w.to(res.weight_dtype))


class EmbeddingFunction(torch.autograd.Function):
    """autograd.Function whose backward is embedding_backward."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, vocab_start: int) -> Tensor:
        x, res = embedding_forward(ids, weight, vocab_start)
        save_residuals(ctx, res)
        return x

    @staticmethod
    def backward(ctx, grad_x: Tensor):
        _, grads = embedding_backward(load_residuals(ctx), grad_x)
        return None, grads.weight, None


def embed(ids: Tensor, weight: Tensor, vocab_start: int = 0, backward: str = "explicit") -> Tensor:
    """Embedding lookup, differentiated by the explicit backward or by plain autograd."""
    if check_backward_mode(backward) == "explicit":
        return EmbeddingFunction.apply(ids, weight, vocab_start)
    return embedding_forward(ids, weight, vocab_start)[0]


class Embedding(nn.Module):
    """Token embedding W[V M] ('V/t M/d'), initialised N(0, init_std^2)."""

    SPECS = {"weight": WEIGHT_SPEC}

    def __init__(self, vocab_size: int, d_model: int, *, init_std: float = 0.02,
                 backward: str = "explicit", dtype=None, device=None):
        super().__init__()
        self.backward = check_backward_mode(backward)
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, ids: Tensor) -> Tensor:
        return embed(ids, self.weight, backward=self.backward)
