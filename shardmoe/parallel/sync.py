"""sync_grads: sum each parameter's gradient over the mesh axes whose ranks saw other tokens.

After a backward every rank holds the gradient of its own tokens. A parameter's gradient is
complete once summed over the axes along which its ranks hold the same values but different
tokens:
    replicated parameters (the gate, any plain nn.Parameter)   over ('d', 'e')
    expert shards (experts split over 'e', sliced over 't')      over ('d',): the ranks along 'e'
        hold other experts, and each expert already received every token of its d slice
Nothing is summed over 't': its ranks hold the same tokens, so a replicated parameter's gradient
is already whole there.

A parameter declares its axes with mark_grad_sync(param, axes); unmarked parameters count as
replicated. A MoE layer's parameters on a mesh that splits them are DTensors on the mesh's 'ep'
and 'tp' dims, and their gradients say what is summed already: a replicated parameter's gradient
is Partial() over 'ep' after the backward, and Replicate() once summed. sync_grads sums such a
gradient over 'd' (which the DTensor does not span: its ranks are data-parallel replicas) and over
the dims where it is Partial, then gives it the parameter's placements, so that a second call does
not sum over 'e' again and torch's tools see a whole gradient either way. A DTensor parameter
that is not the layer's own (what torch.distributed.fsdp.fully_shard makes) is refused by name,
as FSDP reduces its gradient itself (a MoE layer fully_shard-ed over 'd' then sums its replicated
gradients over 'e' in backward). Gradients are bucketed by (axes, dtype, device) and summed with
one psum per bucket.

A summed gradient belongs to one model only if the ranks along a parameter's axes hold the same
value (a gate seeded per rank would otherwise train a different model on every rank, silently;
per-rank clipping or a one-rank update makes them drift apart later). sync_grads checks it at
its first call on a module and every `check_every`-th call after: one all-gather of the parameter
names (as a CRC) and count, one of an exact checksum per parameter, and RankMismatchError on every
rank naming the parameter and the ranks that differ (consistency.check_replicas).

Every call starts with consistency.handshake, naming the MoE layers the module holds, so that a
rank calling sync_grads while another is elsewhere (its next forward, say) gets a RankMismatchError
naming both calls, not a gloo abort, and ranks syncing different layers get one, not each other's
gradients summed.

A second call on a module with no backward in between would sum the gradients over 'd' again
(no placement records that sum), multiplying them by dp, silently. sync_grads remembers the
gradients it left on a module (each tensor and its version counter, which a backward's
accumulation bumps or a new gradient replaces) and refuses, on every rank alike (the handshake
carries each rank's answer), a call that finds every one of them as it left it.
"""
from __future__ import annotations

import math
import weakref
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

from shardmoe.parallel import shardops
from shardmoe.mesh import DEVICE_MESH_NAMES, EXPERT, GRAD_SYNC_ATTRIBUTE, REPLICATED, mark_grad_sync  # noqa: F401 (API)
from shardmoe.moe.composition import is_dtensor, local
from shardmoe.parallel import consistency
from shardmoe.parallel.dtensors import AXIS_OF
from shardmoe.parallel.exchange import ExchangeError
from shardmoe.parallel.expert_parallel import ExpertParallel

_CALLS: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
# per module: the gradients the last sync_grads left (weakly) and their version counters
_LEFT: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def sync_grads(module: torch.nn.Module, mesh, *, check_every: int = consistency.REPLICA_CHECK_EVERY) -> None:
    """Sum every gradient of module over its parameter's axes (in place). Collective: every rank of
    the mesh calls it after the same backward. A parameter without a gradient gets zeros first,
    so every rank contributes the same buckets. check_every: the replicas are compared at the
    first call on module and every check_every-th call after (module docstring)."""
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every: expected an int >= 1, got {check_every!r}")
    if mesh is None or mesh.size(REPLICATED) == 1:
        return
    for name, param in module.named_parameters():
        if is_dtensor(param) and not hasattr(param, GRAD_SYNC_ATTRIBUTE):
            raise ValueError(f"sync_grads: expected parameters that shardmoe reduces, got {name!r} as a DTensor "
                             "it did not make (torch.distributed.fsdp.fully_shard manages it and reduces its "
                             "gradient itself): call sync_grads only on modules FSDP does not manage "
                             "(docs/parallel.md)")
    again = _unchanged_since_last_sync(module)
    consistency.handshake(mesh, "sync_grads", _layer_numbers(module), again)
    if again:  # every rank sent the same row: all refuse
        raise ValueError(f"sync_grads: expected a backward since the last sync_grads of this "
                         f"{type(module).__name__}, got none: its gradients are summed already, and a second call "
                         "would sum them over 'd' again. Call sync_grads once per backward (after the last "
                         "micro-batch's when accumulating)")
    calls = _CALLS.get(module, 0)
    _CALLS[module] = calls + 1
    if calls % check_every == 0:
        check_replicas(module, mesh)
    buckets: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    for param in module.parameters():
        if not param.requires_grad:
            continue
        axes = _unsummed_axes(param, mesh)
        if not axes:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        buckets[(axes, param.dtype, param.device)].append(param)
    # Every rank builds the buckets in the same order: module.parameters() order, first use of a key.
    for (axes, _, _), params in buckets.items():
        flat = torch.cat([local(p.grad).reshape(-1) for p in params])
        try:
            total = shardops.psum("N -> N", flat, mesh, axes=axes)
        except RuntimeError as err:  # a raw gloo error otherwise, as the exchanges report it
            raise ExchangeError(f"sync_grads over mesh axes {axes} failed on rank {mesh.rank}: a peer failed, hung "
                                f"or left; cause: {err}") from err
        for p, part in zip(params, total.split([local(p.grad).numel() for p in params])):
            local(p.grad).copy_(part.view_as(local(p.grad)))
            if is_dtensor(p.grad):  # whole now: the parameter's own placements
                p.grad = type(p.grad).from_local(local(p.grad), p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
    _LEFT[module] = [(weakref.ref(g), g._version) for g in _grads(module)]


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.requires_grad and p.grad is not None]


def _unchanged_since_last_sync(module: torch.nn.Module) -> bool:
    """Whether sync_grads summed module's gradients and no backward has touched any of them since:
    the same gradient tensors at the same versions (a DTensor's own counter: an in-place op on it
    bumps the DTensor's, not its local tensor's)."""
    left, grads = _LEFT.get(module), _grads(module)
    return bool(left) and len(left) == len(grads) and all(
        ref() is g and version == g._version for (ref, version), g in zip(left, grads))


def _layer_numbers(module: torch.nn.Module) -> list[int]:
    """The numbers of the expert-parallel MoE layers in module (consistency.layer_number)."""
    dispatchers = (getattr(getattr(m, "placement", None), "dispatcher", None) for m in module.modules())
    return [d.number for d in dispatchers if isinstance(d, ExpertParallel)]


def _unsummed_axes(param, mesh) -> tuple[str, ...]:
    """The mesh axes of more than one rank over which param's gradient still needs summing: its
    grad-sync axes; for a DTensor parameter, 'd' among them and the dims where its gradient is
    Partial() (a missing gradient counts as the backward leaves one: Partial() over 'ep' when the
    parameter is replicated over 'e')."""
    marked = tuple(a for a in getattr(param, GRAD_SYNC_ATTRIBUTE, REPLICATED) if mesh.size(a) > 1)
    if not is_dtensor(param):
        return marked
    names = param.device_mesh.mesh_dim_names
    if param.grad is None:
        partial = [a for a in marked if DEVICE_MESH_NAMES[a] in names]
    else:
        partial = [AXIS_OF[n] for n, p in zip(names, param.grad.placements) if p.is_partial()]
    return tuple(a for a in marked if a == "d" or a in partial)


def check_replicas(module: torch.nn.Module, mesh) -> None:
    """Raise RankMismatchError on every rank unless every parameter holds the same value on the
    ranks along its grad-sync axes (and every rank has the same parameters). Collective."""
    named = [(name, tuple(a for a in getattr(p, GRAD_SYNC_ATTRIBUTE, REPLICATED) if mesh.size(a) > 1))
             for name, p in module.named_parameters()]
    layout = ";".join(f"{name}:{','.join(axes)}" for name, axes in named)
    shape = {"number of parameters": len(named), "CRC-32 of the parameter names and axes": zlib.crc32(layout.encode())}
    device = next(module.parameters(), torch.empty(0)).device
    table = consistency.gather_table(consistency.settings_words(shape).to(device), mesh, "sync_grads parameter check")
    consistency.check_settings(table, list(shape), f"the parameters of {type(module).__name__}", mesh)
    # a parameter no axis of more than one rank replicates has nothing to compare: 0, on every rank
    checksums = torch.tensor([consistency.checksum(local(p)) if axes else 0
                              for (_, axes), p in zip(named, module.parameters())], dtype=torch.int64)
    table = consistency.gather_table(checksums.to(device), mesh, "sync_grads parameter check")
    consistency.check_replicas(named, table, mesh, "sync_grads")


@torch.no_grad()
def clip_grad_norm_(module: torch.nn.Module, max_norm: float) -> float:
    """The gradient norm of the whole model, sqrt(sum over parameters of ||g||^2 over the WHOLE
    tensor), equal on every rank; the gradients scaled in place by max_norm / (norm + 1e-6) when
    that is below 1, as torch.nn.utils.clip_grad_norm_ scales them. For models whose gradients
    are DTensors on several meshes, which torch.nn.utils.clip_grad_norm_ refuses ('All operands
    in aten.stack.default must have the same mesh'): under FSDP2 the dense parameters' mesh of
    every rank and each MoE layer's 'dp' mesh joined with its 'ep' (and 'tp'). Each rank adds
    ||local g||^2 / replicas, the ranks holding the same block of a gradient being
        replicas = world / (blocks of the gradient)
    blocks: the product of the mesh dims on which its DTensor is split (Shard, _StridedShard); 1
    for a plain tensor, which counts as replicated on every rank. The sharded transformer's
    parameters (dense on the mesh, MoE on its 'ep' x 'tp' part) are counted so too. A gradient
    still Partial() somewhere (before sync_grads) is summed for the norm first, so the norm is
    whole before sync_grads too when dp = 1 and every parameter is a DTensor (a plain gradient, and
    any over 'd', is each rank's share until sync_grads). One all-reduce over the world sums them
    (float64). Collective: every rank calls it after the same backward."""
    from torch.distributed.tensor import Replicate

    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        raise ValueError(f"max_norm: expected a number > 0, got {max_norm!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    grads, total = [], torch.zeros((), dtype=torch.float64)
    for param in module.parameters():
        grad = param.grad
        if grad is None:
            continue
        blocks = 1
        measured = grad
        if is_dtensor(grad):
            if any(p.is_partial() for p in grad.placements):
                measured = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            blocks = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if _splits(p))
        total += local(measured).double().square().sum().cpu() / (world / blocks)
        grads.append(local(grad))
    if world > 1:
        total = total.to(grads[0].device if grads else "cpu")
        dist.all_reduce(total)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s epsilon, so both clip alike
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm


def _splits(placement) -> bool:
    """Whether a DTensor placement cuts the tensor into blocks (Shard, or torch's _StridedShard)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)
