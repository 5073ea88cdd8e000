"""Token embedding with an explicit backward.

    forward:  x[B L M] = sum_V onehot(ids)[B L V] W[V M]        (a row lookup)
    backward: dW[V M]  = sum_{B L} onehot(ids)[B L V] dx[B L M] (index-add of dx into the id's row)

Sharded (docs/model.md "Layout"): ids 'B/d L', weight 'V/t M/d', output 'B/d L M/t'.
    forward:  W[V/t M] = all_gather_d(W[V/t M/d]); each t rank looks up the ids in its vocab block
              (ids of other blocks give zero rows), so x[B/d L M] is a partial sum over t;
              x[B/d L M/t] = psum_scatter_t(x).
    backward: dx[B/d L M] = all_gather_t(dx[B/d L M/t]); dW[V/t M] = index-add of this rank's
              tokens (a partial sum over d); dW[V/t M/d] = psum_scatter_d(dW).
Without a mesh the collectives vanish and the vocab block is the whole vocab.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from shardmoe.parallel import dtensors
from shardmoe.parallel.shardops import all_gather, psum_scatter, unreduced

from .residuals import autograd_grads, check_backward_mode, compute_dtype, forward_autocast, load_residuals, save_residuals
from .sharding import coord, local_shape

WEIGHT_SPEC = "V/t M/d"


def vocab_table(vocab_size: int, d_model: int, init_std: float, mesh, dtype, device) -> nn.Parameter:
    """A vocab_size x d_model table, this rank's block [V/t M/d] drawn N(0, init_std^2) (a DTensor
    of the whole with a mesh: parallel/dtensors.py parameter); the embedding and the unembedding
    both hold one."""
    shape = local_shape(WEIGHT_SPEC, (vocab_size, d_model), mesh)
    local = torch.empty(shape, dtype=dtype, device=device).normal_(std=init_std)
    return nn.Parameter(dtensors.parameter(WEIGHT_SPEC, local, mesh))


def vocab_block_ids(ids: Tensor, block: int, mesh) -> tuple[Tensor, Tensor]:
    """ids as indices into this rank's vocab block of `block` rows (0 outside it), and whether the
    block owns them; the embedding and the unembedding both look ids up this way."""
    local = ids - coord(mesh, "t") * block
    in_block = (local >= 0) & (local < block)
    return torch.where(in_block, local, 0), in_block


class EmbeddingResiduals(NamedTuple):
    local_ids: Tensor   # B L int64: id minus the vocab block's first id, 0 outside the block
    in_block: Tensor    # B L bool: the id belongs to this rank's vocab block
    table_shape: tuple[int, int]  # V/t M: the gathered weight block
    weight_dtype: torch.dtype
    mesh: object        # shardmoe.Mesh or None


class EmbeddingGrads(NamedTuple):
    weight: Tensor  # V/t M/d


def embedding_forward(ids: Tensor, weight: Tensor, mesh=None) -> tuple[Tensor, EmbeddingResiduals]:
    """x = W[ids]; see the module docstring for the sharded layout."""
    table = all_gather("V/t M/d -> V/t M", weight, mesh)
    local, in_block = vocab_block_ids(ids, table.shape[0], mesh)
    # onehot(ids)[B L V/t] . W[V/t M] as a row lookup: it contracts V/t, so each t rank holds a term.
    x = unreduced("B/d L M", table[local] * in_block[..., None].to(table.dtype), "t")
    x = psum_scatter("B/d L M -> B/d L M/t", x, mesh)
    return x, EmbeddingResiduals(local, in_block, tuple(table.shape), weight.dtype, mesh)


def embedding_backward(res: EmbeddingResiduals, grad_x: Tensor) -> tuple[None, EmbeddingGrads]:
    """dW = index_add over tokens of dx; ids have no gradient (returned as None)."""
    grad_x = all_gather("B/d L M/t -> B/d L M", grad_x, res.mesh)
    acc = compute_dtype(res.weight_dtype)  # accumulate repeated ids in float32 for bf16
    rows = grad_x.to(acc) * res.in_block[..., None].to(acc)
    grad_table = torch.zeros(res.table_shape, dtype=acc, device=grad_x.device)
    grad_table.index_add_(0, res.local_ids.reshape(-1), rows.reshape(-1, res.table_shape[1]))
    # The index_add contracts this rank's tokens B/d: a term of the sum over d.
    grad_w = psum_scatter("V/t M -> V/t M/d", unreduced("V/t M", grad_table.to(res.weight_dtype), "d"), res.mesh)
    return None, EmbeddingGrads(grad_w)


class EmbeddingFunction(torch.autograd.Function):
    """autograd.Function whose backward is embedding_backward."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, mesh) -> Tensor:
        x, res = embedding_forward(ids, weight, mesh)
        save_residuals(ctx, res)
        return x

    @staticmethod
    def backward(ctx, grad_x: Tensor):
        with forward_autocast(ctx):
            _, grads = embedding_backward(load_residuals(ctx), grad_x)
        return autograd_grads("EmbeddingFunction.backward", None, grads.weight, None)


def embed(ids: Tensor, weight: Tensor, mesh=None, backward: str = "explicit") -> Tensor:
    """Embedding lookup, differentiated by the explicit backward or by plain autograd."""
    if check_backward_mode(backward) == "explicit":
        return EmbeddingFunction.apply(ids, weight, mesh)
    return embedding_forward(ids, weight, mesh)[0]


class Embedding(nn.Module):
    """Token embedding W[V M] ('V/t M/d'), initialised N(0, init_std^2).

    With a mesh the parameter is a DTensor of the vocab_size x d_model table whose local tensor is
    this rank's block [V/t M/d].
    """

    SPECS = {"weight": WEIGHT_SPEC}

    def __init__(self, vocab_size: int, d_model: int, *, init_std: float = 0.02, mesh=None,
                 backward: str = "explicit", dtype=None, device=None):
        super().__init__()
        self.mesh = mesh
        self.backward = check_backward_mode(backward)
        self.weight = vocab_table(vocab_size, d_model, init_std, mesh, dtype, device)

    def forward(self, ids: Tensor) -> Tensor:
        """ids[B/d L] -> x[B/d L M/t]."""
        return embed(ids, dtensors.compute_view(self.weight), self.mesh, backward=self.backward)
