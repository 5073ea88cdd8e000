"""A rank's shard, named by its spec, as a DTensor of the whole tensor (and back).

shardmoe names the layout of a sharded parameter with a spec ('V/t M/d': rows split over t,
columns over d; shardmoe/notation.py). A DTensor names the same block as a piece of the whole
tensor: on a DeviceMesh whose dims are the mesh axes (names 'dp', 'ep', 'tp'), Shard(i) on the dim
of each axis that splits tensor dim i and Replicate on the others:

    'V/t M/d' on ('dp', 'ep', 'tp')  ->  [Shard(1), Replicate(), Shard(0)]

That is what torch.distributed.checkpoint needs to save every block once and to load any layout
into any other, and what `full_tensor()` gathers. The sharded transformer's dense parameters are
such DTensors (`parameter`), its modules computing on their local tensors (`compute_view`), so
that torch's optimizers, their distributed checkpoints and norms see the whole tensors.

A dim split over two axes ('M/t/d': t major, d minor) is cut by DTensor in the order of the
DeviceMesh's dims, so it needs a DeviceMesh with 'tp' before 'dp'; Mesh.ordered_device_mesh gives
one over the same ranks (its groups are built when it is first asked for, a collective, so
`prepare` asks for every order a model's specs need while the model is built on every rank).
"""
from __future__ import annotations

import torch

from shardmoe.mesh import DEVICE_MESH_NAMES
from shardmoe.notation import global_shape, parse_spec

AXIS_OF = {name: axis for axis, name in DEVICE_MESH_NAMES.items()}


def _live_axes(spec: str, mesh) -> list[tuple[str, ...]]:
    """Per tensor dim, the axes of more than one rank that split it, major first."""
    return [tuple(a for a in dim.axes if mesh.size(a) > 1) for dim in parse_spec(spec).dims]


def device_mesh_for(spec: str, mesh):
    """A DeviceMesh over `mesh`'s ranks whose dim order cuts every dim of `spec` major axis first:
    the mesh's own when its order does, else Mesh.ordered_device_mesh; None when no axis of more
    than one rank splits the spec (the shard is the whole tensor)."""
    per_dim = _live_axes(spec, mesh)
    if not any(per_dim) or mesh.device_mesh is None:
        return None
    own = mesh.device_mesh
    order = [AXIS_OF[n] for n in own.mesh_dim_names]
    if all(list(axes) == sorted(axes, key=order.index) for axes in per_dim):
        return own
    # the axes that split one dim keep their major-first order; the others go after them
    wanted = [a for axes in per_dim if len(axes) > 1 for a in axes]
    return mesh.ordered_device_mesh(tuple(wanted + [a for a in order if a not in wanted]))


def placements(spec: str, device_mesh, mesh) -> list:
    """One placement per dim of device_mesh: Shard(i) where its axis splits tensor dim i (by a
    live axis), else Replicate()."""
    from torch.distributed.tensor import Replicate, Shard

    per_dim = _live_axes(spec, mesh)
    out = []
    for name in device_mesh.mesh_dim_names:
        dims = [i for i, axes in enumerate(per_dim) if AXIS_OF[name] in axes]
        out.append(Shard(dims[0]) if dims else Replicate())
    return out


def prepare(specs, mesh) -> None:
    """Build, on every rank alike, the DeviceMeshes that `whole` will need for these specs."""
    if mesh is not None:
        for spec in specs:
            device_mesh_for(spec, mesh)


def whole(spec: str, local: torch.Tensor, mesh) -> torch.Tensor:
    """The whole tensor whose shard under `spec` this rank holds: a DTensor sharing local's storage
    (a distributed checkpoint loads into it in place), or local itself when nothing splits it."""
    device_mesh = None if mesh is None else device_mesh_for(spec, mesh)
    if device_mesh is None:
        return local
    return _whole_on(device_mesh, spec, local, mesh)


def _whole_on(device_mesh, spec: str, local: torch.Tensor, mesh) -> torch.Tensor:
    """The DTensor on device_mesh of the whole tensor whose shard under `spec` is local (its storage)."""
    from torch.distributed.tensor import DTensor

    shape = global_shape(spec, local.shape, mesh)
    return DTensor.from_local(local, device_mesh, placements(spec, device_mesh, mesh), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def own_local(spec: str, value, mesh) -> torch.Tensor | None:
    """value's local tensor when value is a DTensor laid out as `whole` lays out `spec` on this mesh
    (the same DeviceMesh and placements: what a distributed checkpoint loaded into), else None."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return None
    device_mesh = device_mesh_for(spec, mesh)
    if device_mesh is None or value.device_mesh != device_mesh:
        return None
    return value.to_local() if list(value.placements) == placements(spec, device_mesh, mesh) else None


def parameter(spec: str, local: torch.Tensor, mesh) -> torch.Tensor:
    """The data of a parameter laid out by `spec` whose shard on this rank is `local`: with a mesh of
    more than one rank, the DTensor of the whole tensor sharing local's storage (on
    device_mesh_for(spec), or the mesh's own DeviceMesh, every placement Replicate(), when no axis
    of more than one rank splits it); else local itself."""
    if mesh is None or mesh.device_mesh is None or mesh.size() == 1:
        return local
    return _whole_on(device_mesh_for(spec, mesh) or mesh.device_mesh, spec, local, mesh)


def compute_view(param: torch.Tensor) -> torch.Tensor:
    """The tensor a module computes on for a parameter that `parameter` made: a DTensor's local
    tensor, differentiable, whose gradient reaches the parameter as a DTensor that is Partial() on
    each token-parallel dim ('dp', 'ep') that does not split it (each rank's gradient is its own
    tokens' share until sync_grads sums it) and the parameter's placement elsewhere; a plain
    parameter as it is."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(param, DTensor):
        return param
    grad = [Partial() if name in ("dp", "ep") and p.is_replicate() else p
            for name, p in zip(param.device_mesh.mesh_dim_names, param.placements)]
    return param.to_local(grad_placements=grad)
