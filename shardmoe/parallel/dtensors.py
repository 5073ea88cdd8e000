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

A user's model holding sharded MoE layers beside plain modules (an nn.Linear before the layer) has
two kinds of parameters, which torch's tools that take them all at once refuse ("mixed
torch.Tensor and DTensor": clip_grad_norm_, foreach optimizers): `replicate_plain_parameters`
makes the plain ones DTensors, Replicate() on the layers' DeviceMesh, their modules computing on
`compute_view` of them.
"""
from __future__ import annotations

import torch

from shardmoe.mesh import DEVICE_MESH_NAMES, GRAD_SYNC_ATTRIBUTE, REPLICATED, mark_grad_sync
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


def replicate_plain_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Make every plain parameter of `model` a DTensor, Replicate() on the DeviceMesh of its DTensor
    parameters (a sharded MoE layer's mesh.parameter_mesh), so that torch's tools that take all
    parameters at once (torch.nn.utils.clip_grad_norm_, an optimizer with foreach=True) see one kind
    of tensor, on one mesh. Returns model, changed in place; a model without DTensor parameters (no
    mesh, or one whose only axis of more than one rank is 'dp') is left as it is.

    Each module owning such a parameter computes on its local tensor: a forward pre-hook puts
    compute_view(param) in the parameter's place for the forward (its gradient reaches the parameter
    as a DTensor, Partial() on 'ep', as the router's), and a forward hook puts the parameter back,
    also when the forward raises. So outside a forward, model.parameters(), state_dict() and the
    optimizer see DTensors; sync_grads sums their gradients over 'd' and 'e' as the router's, and
    load_state_dict takes a plain entry (the whole tensor) as well as a DTensor. A parameter that
    .to() / .double() (which swap a DTensor parameter's contents, its attributes with them) or
    load_state_dict(assign=True) (a new Parameter) put in place gets its grad-sync mark back at the
    next forward, when it is still the Replicate() DTensor this call made. A
    parameter read by another module's forward than its owner's stays a DTensor there, and torch
    refuses it ("mixed torch.Tensor and DTensor"). A parameter shared by several modules (tied
    weights) stays one parameter. Call it before the optimizer is built (it holds the parameters)
    and before the first backward; ValueError for a model with DTensor parameters on another mesh
    than its layers' parameter mesh (FSDP2's: shardmoe.parallel.clip_grad_norm_ takes those), with
    layers on several, or with a plain parameter that has a gradient."""
    from torch.distributed.tensor import DTensor, Replicate

    from shardmoe.moe.layer import MoE

    meshes = list(dict.fromkeys(p.device_mesh for p in model.parameters() if isinstance(p, DTensor)))
    if not meshes:
        return model
    layers = list(dict.fromkeys(m.mesh.parameter_mesh for m in model.modules()
                                if isinstance(m, MoE) and m.mesh is not None and m.mesh.parameter_mesh is not None))
    if len(layers) != 1 or meshes != layers:
        raise ValueError(f"model: expected every DTensor parameter on the DeviceMesh of its sharded MoE layers' "
                         f"parameters (one mesh.parameter_mesh), got DTensor parameters on mesh dims "
                         f"{', '.join(str(m.mesh_dim_names) for m in meshes)} and layers' parameter meshes on "
                         f"{', '.join(str(m.mesh_dim_names) for m in layers) or 'none'}: a model that FSDP2 "
                         "(fully_shard) or another tool made DTensors is not for this call (fully_shard its plain "
                         "modules too; shardmoe.parallel.clip_grad_norm_ takes the norm over several meshes)")
    device_mesh = meshes[0]
    owners = [(module, [n for n, p in module._parameters.items() if p is not None and not isinstance(p, DTensor)])
              for module in model.modules()]
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor) and param.grad is not None:
            raise ValueError(f"{name}: expected a parameter without a gradient (call replicate_plain_parameters "
                             "before the first backward), got one with a gradient")
    replicated: dict[int, torch.nn.Parameter] = {}  # by id of the plain parameter: tied weights stay one
    for module, names in owners:
        for name in names:
            param = module._parameters[name]
            if id(param) not in replicated:
                whole = DTensor.from_local(param.detach(), device_mesh, [Replicate()] * device_mesh.ndim,
                                           run_check=False)
                replicated[id(param)] = torch.nn.Parameter(whole, requires_grad=param.requires_grad)
                # marked, as sync_grads sums only the DTensors shardmoe made (an unmarked one is FSDP's)
                mark_grad_sync(replicated[id(param)], getattr(param, GRAD_SYNC_ATTRIBUTE, REPLICATED))
            setattr(module, name, replicated[id(param)])
        if names:
            hooks = _ReplicatedHooks({n: getattr(module._parameters[n], GRAD_SYNC_ATTRIBUTE) for n in names},
                                     device_mesh)
            module.register_forward_pre_hook(hooks.put_views)
            module.register_forward_hook(hooks.put_back, always_call=True)
            module.register_load_state_dict_pre_hook(hooks.replicate_entries)
    return model


class _ReplicatedHooks:
    """The hooks of a module whose parameters replicate_plain_parameters made DTensors (`marks`: their
    names and grad-sync axes; `device_mesh`: theirs): compute_view of each for the forward and the
    parameter back after it (a stack, so that a module whose forward calls itself gets its own back
    at each level); a plain state-dict entry, the whole tensor on every rank, taken as the
    Replicate() DTensor it stands for (torch's copy_ into a DTensor refuses a plain tensor); before
    each forward, the grad-sync mark put back on a parameter that lost it (mark_own)."""

    def __init__(self, marks: dict[str, tuple[str, ...]], device_mesh):
        self.names, self.marks, self.device_mesh, self.stack = tuple(marks), marks, device_mesh, []

    def mark_own(self, module) -> None:
        """Mark again each parameter laid out as replicate_plain_parameters lays it out (Replicate()
        on its DeviceMesh) that has no mark: module.to() swaps a DTensor parameter's contents and
        attributes, load_state_dict(assign=True) puts a new Parameter in place. One of another
        layout (fully_shard's, applied since) stays unmarked, so that sync_grads still refuses it."""
        from torch.distributed.tensor import DTensor

        for name, axes in self.marks.items():
            param = module._parameters.get(name)
            if (isinstance(param, DTensor) and not hasattr(param, GRAD_SYNC_ATTRIBUTE)
                    and param.device_mesh == self.device_mesh and all(p.is_replicate() for p in param.placements)):
                mark_grad_sync(param, axes)

    def put_views(self, module, args) -> None:
        from torch.distributed.tensor import DTensor

        self.mark_own(module)
        own = {n: module._parameters[n] for n in self.names if isinstance(module._parameters.get(n), DTensor)}
        self.stack.append(own)
        for name, param in own.items():
            module._parameters[name] = compute_view(param)  # a tensor, not a Parameter: only for this forward

    def put_back(self, module, args, output) -> None:
        for name, param in self.stack.pop().items():
            module._parameters[name] = param

    def replicate_entries(self, module, state_dict, prefix, *args) -> None:
        from torch.distributed.tensor import DTensor

        for name in self.names:
            param, value = module._parameters.get(name), state_dict.get(prefix + name)
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                state_dict[prefix + name] = DTensor.from_local(value, param.device_mesh, param.placements,
                                                               run_check=False)
