"""How a MoE layer composes with torch.distributed's FSDP2 and distributed checkpoints.

  local(t)                      this rank's block of a parameter (a DTensor's local tensor)
  compute_views(layer)          the local tensors the forward computes on, their gradients
                                DTensors of the placements the backward leaves
  check_parameters(layer)       refuse parameters laid out other than the layer lays them out
  fully_sharded_over_d(layer)   fully_shard over exactly the layer's 'd' ranks: FSDP's mean
                                convention (the layer's forward asks, and its backward adapts)
  check_own_shards(layer)       refuse expert shards that fully_shard replaced elsewhere
  mean_over_e(...)              the backward's part of that convention: replicated gradients summed
                                over 'e', every gradient divided by e
  state_entries / shard_entries the state-dict hooks: whole logical tensors (DTensors over the
                                mesh) out, this rank's shards (FSDP's DTensors under FSDP) in
  mark_assigned                 the load hook after them: parameters load_state_dict(assign=True)
                                put in place get the layer's grad-sync marks
  local_tokens(layer, x)        a DTensor input's local tokens, when its blocks are the layer's

docs/parallel.md ("A torch DeviceMesh as the mesh", "Distributed checkpoints", "FSDP2") has the
decisions and the tests.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardmoe.mesh import DEVICE_MESH_NAMES, EXPERT, GRAD_SYNC_ATTRIBUTE, REPLICATED, mark_grad_sync
from shardmoe.moe import shared_experts as shared_ex

# DTensor, or nothing isinstance matches where torch has no distributed package (the layer's
# forward tests its input and parameters with isinstance on it: no call into this module)
try:
    from torch.distributed.tensor import DTensor as DTENSOR
except ImportError:
    DTENSOR = ()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of t: a DTensor's local tensor (its storage, under no_grad), else t."""
    return t.to_local() if is_dtensor(t) else t


def compute_views(layer) -> list[torch.Tensor | None]:
    """gate_weight, gate_bias, then the routed and shared experts' parameters, as the local tensors
    the MoE operators compute on (Placement.compute_view): no DTensor dispatch runs inside them.
    Each view's gradient reaches its parameter as a DTensor of the placements the backward leaves:
    the experts' own, and the replicated parameters' Partial() over 'ep' (each rank's tokens'
    share), or Replicate() when the backward sums them over 'e' itself (fully_sharded_over_d)."""
    summed = fully_sharded_over_d(layer)
    names = ("gate_weight", "gate_bias", *layer.config.expert_param_names, *layer.config.shared_param_names)
    return [None if getattr(layer, n) is None else layer.placement.compute_view(n, getattr(layer, n), summed)
            for n in names]


def check_parameters(layer) -> None:
    """Refuse, before the forward computes, a parameter laid out other than the layer lays it out:
    plain where the mesh splits nothing, else a DTensor on mesh.parameter_mesh with the layer's
    placements (expert_tensor.parameter_placements; FSDP2 hands the forward the same). A
    parameter put in place by other code (distribute_module, an assignment) is named with its
    layout, e.g. a plain tensor where the layer shards, which it would take for its own shard."""
    for name, param in layer.named_parameters(recurse=False):
        layout = layer.placement.layout(name)
        got = (param.device_mesh, tuple(param.placements)) if is_dtensor(param) else None
        if layout is None and got is not None:
            raise ValueError(f"{name}: expected a plain tensor (the layer's mesh splits no parameter), got a "
                             f"DTensor with placements {list(got[1])} on mesh dims {got[0].mesh_dim_names}")
        if layout is not None and got != (layout[0], tuple(layout[1])):
            shown = "a plain tensor" if got is None else f"placements {list(got[1])} on mesh dims {got[0].mesh_dim_names}"
            raise ValueError(f"{name}: expected a DTensor with placements {list(layout[1])} on the layer's parameter "
                             f"mesh, dims {layout[0].mesh_dim_names} (this rank's shard of the whole, as the layer "
                             f"made it), got {shown}")


def fully_sharded_over_d(layer) -> bool:
    """True when torch.distributed.fsdp.fully_shard was applied to `layer` over exactly the
    ranks along its mesh's 'd' axis (this rank's data-parallel replicas, which hold the same
    experts), torchtitan's composition. Its gradients then follow FSDP's mean convention, each
    rank's loss being the mean over its own tokens plus aux_loss: FSDP averages over 'd' (its
    default); the layer's backward, before FSDP's reduce-scatter, sums the replicated gradients
    (router, shared expert) over 'e' and divides all its gradients by e; and the balance
    losses' scale is multiplied by d e, as each rank's aux_loss is its share of the batch's.
      replicated  sum over (d, e) / (d e)
      experts     sum over d / (d e)  (an expert's gradient on a rank covers every 'e' rank's tokens
                                       of its d slice, each a mean over its own tokens)
    (FSDP's own divide factor could carry the 1/e, but torch 2.13 divides twice by a custom
    factor on a one-rank mesh in float64 and float16: the ep4 test caught it.)
    fully_shard over other ranks (every rank: it would take the expert shards for whole
    parameters and mix the ranks' experts) raises ValueError naming both sets of ranks."""
    if layer.mesh is None:
        return False
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(layer, FSDPModule):
        return False
    group = layer._get_fsdp_state()._fsdp_param_group
    if group is None:
        return False
    fsdp_ranks = sorted(group.mesh_info.mesh.mesh.flatten().tolist())
    d_ranks = sorted(layer.mesh.ranks_along("d"))
    if fsdp_ranks != d_ranks:
        raise ValueError(f"fully_shard: expected this layer sharded over the ranks along its mesh's 'd' axis, "
                         f"{d_ranks} (the ranks that hold this rank's experts), got ranks {fsdp_ranks}: FSDP "
                         "would take each rank's shard of the experts for a whole parameter and mix the "
                         "ranks' experts. Pass fully_shard the 'dp' dimension of the layer's mesh "
                         "(docs/parallel.md)")
    return True


def check_own_shards(layer) -> None:
    """Refuse, on a layer sharded over 'e' or 't', shards that are not the parameters it made (their
    grad-sync mark is gone): torch.distributed.fsdp.fully_shard applied to a module holding the
    layer, rather than to the layer, puts FSDP's parameters in their place without the layer being
    an FSDP module, so the layer cannot take FSDP's mean convention (fully_sharded_over_d) and its
    gradients would come out e times too large beside unscaled balance losses, a silently wrong
    model; so this raises before any work. (Over ranks other than 'd' torch itself refuses the
    layer's DTensor parameters at fully_shard.) Replicated parameters (the gate; the shared expert
    unless t splits it) are not checked."""
    axes = [a for a in ("e", "t") if layer.mesh.size(a) > 1]
    sharded = (*layer.config.expert_param_names, *(layer.config.shared_param_names if "t" in axes else ()))
    for name in sharded:
        param = getattr(layer, name)
        if param is not None and not hasattr(param, GRAD_SYNC_ATTRIBUTE):
            raise ValueError(
                f"{name}: expected the parameter this layer made (this rank's shard over mesh axes {axes}, "
                f"marked for sync_grads), got another in its place ({type(param).__name__} of shape "
                f"{list(param.shape)}, unmarked). torch.distributed.fsdp.fully_shard on a module holding this "
                "layer does that, and the layer's gradients would then miss FSDP's mean convention: apply "
                "fully_shard to the layer itself, over its mesh's 'dp' dimension, before its parent "
                "(docs/parallel.md)")


def state_entries(layer, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: each routed or shared expert parameter's entry is the whole logical
    tensor, the same on every mesh (moe/placement.py Placement.state_entry): gate_up_proj as its
    [E, 2, F, H] view ([E, 2, F] for its bias, [2, Fs, H] for the shared expert's), and with a mesh
    that splits it a DTensor over the mesh's DeviceMesh (Shard(0) over 'ep' for the experts,
    Shard on the F dim over 'tp', Replicate over 'dp') sharing this rank's shard, so that
    torch.distributed.checkpoint saves and loads every expert once and reshards to any layout. The
    router's tensors (replicated) are plain: their parameters' Replicate() DTensors give their
    local tensor, the whole. Under fully_shard over 'd' a parameter is FSDP's DTensor, whose whole
    tensor over 'dp' is this rank's shard of the layer's: an expert's is gathered over 'd' (a copy,
    and a collective, as FSDP's state dicts are) and presented the same way; the router's stays
    FSDP's."""
    from torch.distributed.tensor import DTensor

    for name in _sharded_names(layer):
        if prefix + name in state_dict:
            param = getattr(layer, name).detach()
            if isinstance(param, DTensor) and param.device_mesh != _parameter_mesh(layer):  # FSDP's shard
                param = param.redistribute(placements=_gathered_over_fsdp(param, layer))
            state_dict[prefix + name] = layer.placement.state_entry(name, local(param))
    for name in ("gate_weight", "gate_bias"):
        entry = state_dict.get(prefix + name)
        if isinstance(entry, DTensor) and entry.device_mesh == _parameter_mesh(layer):
            state_dict[prefix + name] = local(entry)


def _parameter_mesh(layer):
    """The DeviceMesh of the layer's DTensor parameters (Mesh.parameter_mesh), or None."""
    return None if layer.mesh is None else layer.mesh.parameter_mesh


def shard_entries(layer, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: each expert parameter's entry becomes this rank's shard in the
    parameter's shape (Placement.load_entry): a DTensor as state_entries makes it on this mesh
    gives its local shard; a whole tensor (plain, in the state-dict layout or the parameter's, or a
    DTensor of another layout, gathered whole: a collective over its mesh) is cut to the shard.
    Any other shape raises ValueError naming the key, the expected and the actual shape. Each
    plain entry of a DTensor parameter then becomes a DTensor laid out as the parameter: the
    layer's own (its local tensor the entry), or under fully_shard over 'd' FSDP's (every 'd' rank
    holds the same shard: each keeps its block). No communication either way."""
    from torch.distributed.tensor import DTensor

    for name in _sharded_names(layer):
        key = prefix + name
        if key in state_dict and getattr(layer, name) is not None:
            state_dict[key] = layer.placement.load_entry(key, name, state_dict[key], layer._whole_shapes[name])
    for name, param in layer.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            # value is this rank's shard in the layer's layout: whole over any 'dp', cut to FSDP's block
            whole_over_d = DTensor.from_local(value.to(param.dtype), param.device_mesh,
                                              _gathered_over_fsdp(param, layer), run_check=False,
                                              shape=param.shape, stride=param.stride())
            state_dict[prefix + name] = whole_over_d.redistribute(placements=param.placements)


def mark_assigned(layer, incompatible_keys) -> None:
    """load_state_dict post-hook: a parameter that load_state_dict(assign=True) put in place (the
    state dict's tensor, laid out by shard_entries as the parameter it replaces) has lost the
    grad-sync mark of the layer's own (layer.py _parameter): it gets it back, EXPERT for the routed
    experts and REPLICATED for the router and the shared expert, when it is laid out as the layer
    lays that parameter out. A parameter of another layout keeps its missing mark, so that
    check_own_shards still refuses what fully_shard over a module holding the layer put in place."""
    from torch.distributed.tensor import DTensor

    for name, param in layer.named_parameters(recurse=False):
        if hasattr(param, GRAD_SYNC_ATTRIBUTE):
            continue
        layout = layer.placement.layout(name)
        own = (not isinstance(param, DTensor) if layout is None else isinstance(param, DTensor) and
               (param.device_mesh, tuple(param.placements)) == (layout[0], tuple(layout[1])))
        if own:
            mark_grad_sync(param, EXPERT if name in layer.config.expert_param_names else REPLICATED)


def _gathered_over_fsdp(param, layer) -> list:
    """The placements of a parameter of FSDP2 (a DTensor on its 'dp' mesh, or on 'dp' joined with the
    layer's parameter mesh) with every dim that is not the layer's Replicate(): the layout in which
    each rank's local tensor is its shard in the layer's own layout."""
    from torch.distributed.tensor import Replicate

    own = () if _parameter_mesh(layer) is None else _parameter_mesh(layer).mesh_dim_names
    return [p if n in own else Replicate() for n, p in zip(param.device_mesh.mesh_dim_names, param.placements)]


def _sharded_names(layer) -> tuple[str, ...]:
    """The parameters the placement shards and the state-dict hooks present whole: the routed
    experts', then the shared expert's."""
    return (*layer.config.expert_param_names, *layer.config.shared_param_names)


def mean_over_e(group, size: int, replicated: list[torch.Tensor], experts: list[torch.Tensor]) -> None:
    """In place: the replicated gradients summed over the 'e' group (one all-reduce of them
    flattened), then every gradient divided by its size e (fully_sharded_over_d)."""
    if replicated:
        flat = torch.cat([g.reshape(-1) for g in replicated])
        dist.all_reduce(flat, group=group)
        for g, part in zip(replicated, flat.split([g.numel() for g in replicated])):
            g.copy_(part.view_as(g))
    for g in (*replicated, *experts):
        g.div_(size)


def is_dtensor(t) -> bool:
    """Whether t is a DTensor (never, where torch has no distributed package)."""
    return isinstance(t, DTENSOR)


def local_tokens(layer, x) -> torch.Tensor:
    """The local tensor of a DTensor input x [..., H] whose blocks are the tokens this rank gives
    the layer: Shard(0) over each of the layer's mesh axes 'dp' and 'ep' that has more than one
    rank (along the same ranks, 'dp' before 'ep', so that the blocks concatenate in the layer's
    token order, 'B/d/e'), Replicate over its 'tp', and over any other dim Replicate or a Shard
    that leaves H whole (ranks the layer treats as separate replicas, as for a plain tensor). The
    layer is not linear in x and mixes H, so a Partial placement or a split H is refused, like any
    other layout: ValueError naming the dims, the placements and what each needs; nothing runs."""
    mesh, device_mesh, placements = layer.mesh, x.device_mesh, tuple(x.placements)
    names = device_mesh.mesh_dim_names or tuple(f"dim {i}" for i in range(device_mesh.ndim))
    coordinate = device_mesh.get_coordinate()
    live = {DEVICE_MESH_NAMES[a]: a for a in ("d", "e", "t") if mesh is not None and mesh.size(a) > 1}
    problems = []
    for i, (name, placement) in enumerate(zip(names, placements)):
        if placement.is_partial():
            problems.append(f"{name}: Partial, but the layer is not linear in x")
        elif placement.is_shard() and placement.dim % x.dim() == x.dim() - 1:
            problems.append(f"{name}: {placement!r} splits H, which the router and the experts need whole")
        elif live.get(name) in ("d", "e"):
            along = device_mesh.mesh[tuple(coordinate[:i]) + (slice(None),) + tuple(coordinate[i + 1:])].tolist()
            if not (placement.is_shard() and placement.dim == 0):
                problems.append(f"{name}: {placement!r}, expected Shard(0) (the layer's ranks along "
                                f"'{live[name]}' hold different tokens)")
            elif along != mesh.ranks_along(live[name]):
                problems.append(f"{name}: ranks {along}, but the layer's '{live[name]}' ranks are "
                                f"{mesh.ranks_along(live[name])}")
        elif live.get(name) == "t" and not placement.is_replicate():
            problems.append(f"{name}: {placement!r}, expected Replicate() (the layer's 't' ranks share their tokens)")
    missing = [n for n, a in live.items() if a in ("d", "e") and n not in names]
    problems += [f"{n}: absent, expected Shard(0) over the layer's '{live[n]}' ranks" for n in missing]
    if not missing and all(n in names for n in ("dp", "ep")) and {"dp", "ep"} <= set(live) and \
            names.index("dp") > names.index("ep"):
        problems.append("ep before dp: the blocks would concatenate e-major, the layer's tokens are d-major")
    if problems:
        raise ValueError(f"x: expected a DTensor whose blocks are the layer's tokens, got placements "
                         f"{list(placements)} on mesh dims {list(names)}: " + "; ".join(problems))
    return x.to_local()
