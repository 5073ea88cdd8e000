"""The collectives the dense layers use, with `mesh=None` meaning a single process.

The layers write their math on local shards and call these at the seams (seed 002's pattern:
all_gather weights over d before use, psum_scatter gradients back; psum_scatter over t after a
projection that contracts a t-sharded dim). With a shardmoe.Mesh they are shardmoe.shardops'
differentiable collectives, so the same forward code also trains under plain autograd; with
mesh=None they do nothing. Gradient convention (shardops'): a tensor replicated over t that feeds
t-sharded work gets a gradient that is *partial* over t, and the all_gather that produced it sums
those partials in its backward (a psum_scatter).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from shardmoe import notation, shardops


def gather(spec: str, x: Tensor, mesh) -> Tensor:
    """all_gather along the axes the spec drops, e.g. 'M/d Q K/t D -> M Q K/t D'."""
    if mesh is None:
        return x
    return shardops.all_gather(spec, x, mesh)


def reduce_scatter(spec: str, x: Tensor, mesh) -> Tensor:
    """Sum a per-rank partial over the axes the spec adds and keep this rank's block."""
    if mesh is None:
        return x
    return shardops.psum_scatter(spec, x, mesh)


def psum(spec: str, x: Tensor, mesh, axes: str) -> Tensor:
    """Sum a per-rank partial over `axes`; the gradient passes through unchanged."""
    if mesh is None or mesh.size(axes) == 1:
        return x
    return shardops.psum(spec, x, mesh, axes=axes)


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
