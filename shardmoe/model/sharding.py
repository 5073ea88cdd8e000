"""Sharding helpers of the dense layers beyond shardmoe.parallel.shardops, with `mesh=None` a single process.

The layers write their math on local shards and call shardops at the seams (FSDP over d plus
Megatron tensor parallelism over t, docs/model.md "Layout": all_gather weights over d before use,
psum_scatter gradients back; psum_scatter over t after a projection that contracts a t-sharded
dim). Every contraction over a sharded dim goes through
shardops.einsum_unreduced (or shardops.unreduced for a lookup or an index_add), so its result is
an Unreduced that only a psum or psum_scatter turns back into a tensor, also with mesh=None.
Gradient convention (shardops'): a tensor replicated over t that feeds t-sharded work gets a
gradient that is *partial* over t, and the all_gather that produced it sums those partials in its
backward (a psum_scatter); `leave_partial` hands such a gradient to autograd.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from shardmoe import notation
from shardmoe.parallel import shardops


def leave_partial(grad: shardops.Unreduced, axis: str) -> Tensor:
    """The local tensor of a gradient Unreduced over exactly `axis`, handed to autograd as a plain
    tensor: by the gradient convention the layer before sums it (the dual of its all_gather).
    Raises UnreducedError when the gradient is not unreduced over exactly that axis."""
    if not isinstance(grad, shardops.Unreduced) or grad.axes != {axis}:
        raise shardops.UnreducedError(f"a gradient leaving partial over {axis!r} must be unreduced over {{{axis}}} "
                                      f"only, got {grad!r}")
    return grad.partial


def pmax(x: Tensor, mesh, axis: str) -> Tensor:
    """Elementwise max over the ranks of `axis`; not differentiable (used only as a detached shift)."""
    x = x.detach()
    if mesh is None or mesh.size(axis) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=mesh.group(axis))
    return out


def coord(mesh, axis: str) -> int:
    """This rank's block index along `axis` (0 without a mesh)."""
    return 0 if mesh is None else mesh.coord(axis)


def size(mesh, axis: str) -> int:
    """Number of ranks along `axis` (1 without a mesh)."""
    return 1 if mesh is None else mesh.size(axis)


def local_shape(spec: str, global_shape: tuple[int, ...], mesh) -> tuple[int, ...]:
    """This rank's block shape of a tensor of `global_shape` laid out as `spec`."""
    return tuple(global_shape) if mesh is None else notation.local_shape(spec, global_shape, mesh)


class _KeepBlock(torch.autograd.Function):
    """Forward: this rank's block of a replicated tensor. Backward: all_gather of the block gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, spec: str, mesh) -> Tensor:
        ctx.spec, ctx.mesh = spec, mesh
        return shardops.shard(spec, x, mesh).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        source, target = ctx.spec.split("->")
        return shardops.all_gather(f"{target} -> {source}", grad.contiguous(), ctx.mesh), None, None


def keep_block(spec: str, x: Tensor, mesh) -> Tensor:
    """This rank's block of a tensor that every rank holds whole, e.g. 'B L M -> B L M/t'.

    Unlike shardops.shard (whose gradient is zero outside the block, i.e. partial), the gradient
    leaves *whole* on every rank: the producer of x (the MoE layer, whose row-parallel experts
    psum their output over t) needs the full output gradient on each t rank.
    """
    if mesh is None:
        return x
    return _KeepBlock.apply(x, spec, mesh)


class _WholeToPartialGrad(torch.autograd.Function):
    """Forward: identity. Backward: the gradient on coordinate 0 of the axis, zeros elsewhere."""

    @staticmethod
    def forward(ctx, x: Tensor, mesh, axis: str) -> Tensor:
        ctx.keep = mesh.coord(axis) == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad if ctx.keep else torch.zeros_like(grad)), None, None


def whole_to_partial_grad(x: Tensor, mesh, axis: str) -> Tensor:
    """Mark a replicated x whose consumer returns a *whole* gradient (equal on every rank of
    `axis`) while x's producer expects a *partial* one (summed over `axis` by its dual).

    The whole gradient is kept on coordinate 0 and zeroed elsewhere: the partials then sum to
    exactly the whole gradient (dividing by |axis| instead would round for |axis| > 2).
    """
    if mesh is None or mesh.size(axis) == 1:
        return x
    return _WholeToPartialGrad.apply(x, mesh, axis)
