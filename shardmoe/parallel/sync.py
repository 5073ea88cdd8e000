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
replicated. sync_grads is for modules FSDP does not manage: a DTensor parameter (what
torch.distributed.fsdp.fully_shard makes) is refused by name, as FSDP reduces its gradient itself
(a MoE layer fully_shard-ed over 'd' then sums its replicated gradients over 'e' in backward).
Gradients are bucketed by (axes, dtype, device) and summed with one psum per bucket.

A summed gradient belongs to one model only if the ranks along a parameter's axes hold the same
value (a gate seeded per rank would otherwise train a different model on every rank, silently).
The first sync_grads of a module checks it: one all-gather of the parameter names (as a CRC) and
count, one of an exact checksum per parameter, and RankMismatchError on every rank naming the
parameter and the ranks that differ (consistency.check_replicas). Later calls skip the check.
"""
from __future__ import annotations

import weakref
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

from shardmoe import shardops
from shardmoe.notation import parse_spec
from shardmoe.mesh import EXPERT, GRAD_SYNC_ATTRIBUTE, REPLICATED, mark_grad_sync  # noqa: F401  (this module's API)
from shardmoe.parallel import consistency
from shardmoe.parallel.exchange import ExchangeError

_REPLICAS_CHECKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def sync_grads(module: torch.nn.Module, mesh) -> None:
    """Sum every gradient of module over its parameter's axes (in place). Collective: every rank of
    the mesh calls it after the same backward. A parameter without a gradient gets zeros first,
    so every rank contributes the same buckets."""
    if mesh is None or mesh.size(REPLICATED) == 1:
        return
    from torch.distributed.tensor import DTensor

    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(f"sync_grads: expected parameters that shardmoe reduces, got {name!r} as a DTensor "
                             "(torch.distributed.fsdp.fully_shard manages it and reduces its gradient itself): "
                             "call sync_grads only on modules FSDP does not manage (docs/parallel.md)")
    if module not in _REPLICAS_CHECKED:
        check_replicas(module, mesh)
        _REPLICAS_CHECKED.add(module)
    buckets: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    for param in module.parameters():
        if not param.requires_grad:
            continue
        axes = tuple(a for a in getattr(param, GRAD_SYNC_ATTRIBUTE, REPLICATED) if mesh.size(a) > 1)
        if not axes:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        buckets[(axes, param.dtype, param.device)].append(param)
    # Every rank builds the buckets in the same order: module.parameters() order, first use of a key.
    for (axes, _, _), params in buckets.items():
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        try:
            total = shardops.psum("N -> N", flat, mesh, axes=axes)
        except RuntimeError as err:  # a raw gloo error otherwise, as the exchanges report it
            raise ExchangeError(f"sync_grads over mesh axes {axes} failed on rank {mesh.rank}: a peer failed, hung "
                                f"or left; cause: {err}") from err
        for p, part in zip(params, total.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p.grad))


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
    checksums = torch.tensor([consistency.checksum(p) for _, p in module.named_parameters()], dtype=torch.int64)
    table = consistency.gather_table(checksums.to(device), mesh, "sync_grads parameter check")
    consistency.check_replicas(named, table, mesh, "sync_grads")


@torch.no_grad()
def clip_grad_norm_(module: torch.nn.Module, max_norm: float) -> float:
    """The gradient norm of the whole model, sqrt(sum over parameters of ||g||^2 over the WHOLE
    tensor), equal on every rank; the gradients scaled in place by max_norm / (norm + 1e-6) when
    that is below 1, as torch.nn.utils.clip_grad_norm_ scales them. For models that FSDP shards:
    torch.nn.utils.clip_grad_norm_ refuses DTensors on several meshes (the dense parameters' and
    each MoE layer's 'dp' mesh), and a MoE layer's experts, FSDP's DTensors over 'dp' only, are
    besides split over 'e' (and 't') by the layer, which no DTensor placement says. Each rank adds
    ||local g||^2 / replicas, the ranks holding the same block of a parameter being
        replicas = world / (holders * split)
    holders: the ranks of the gradient's DTensor mesh (1 for a plain tensor); split: for a MoE
    layer's expert and shared-expert parameters, the ranks its shard spec splits it over
    (expert_tensor.SHARD_SPECS: 'E/e 2 F/t H' is split ep * tp ways, down_proj_bias 'E/e H' ep
    ways, shared_gate_weight not at all), else 1. One all-reduce over the world sums them (float64). Collective: every rank calls it after the same backward. Plain
    tensors outside MoE layers count as replicated on every rank: the sharded transformer, whose
    dense weights are plain shards, has its own (shardmoe/train/optim.py global_grad_norm)."""
    from torch.distributed.tensor import DTensor

    from shardmoe.moe.layer import MoE
    from shardmoe.parallel.expert_tensor import SHARD_SPECS

    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        raise ValueError(f"max_norm: expected a number > 0, got {max_norm!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    grads, total = [], torch.zeros((), dtype=torch.float64)
    for layer in module.modules():
        split = {}
        if isinstance(layer, MoE) and layer.mesh is not None:
            split = {name: layer.mesh.size(parse_spec(local).axes) for name, (_, local) in SHARD_SPECS.items()}
        for name, param in layer.named_parameters(recurse=False):
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            holders = grad.device_mesh.size() if isinstance(grad, DTensor) else 1
            total += local.double().square().sum().cpu() / (world / (holders * split.get(name, 1)))
            grads.append(local)
    if world > 1:
        total = total.to(grads[0].device if grads else "cpu")
        dist.all_reduce(total)
    norm = float(total.sqrt())
    coef = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s epsilon, so both clip alike
    if coef < 1:
        for local in grads:
            local.mul_(coef)
    return norm
