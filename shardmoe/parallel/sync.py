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
replicated. A parameter that is sharded and reduced by its own layer (FSDP) is marked with ().
Gradients are bucketed by (axes, dtype, device) and summed with one psum per bucket.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from shardmoe import shardops

GRAD_SYNC_ATTRIBUTE = "grad_sync_axes"
REPLICATED = ("d", "e")
EXPERT = ("d",)


def mark_grad_sync(param: torch.nn.Parameter, axes: tuple[str, ...]) -> None:
    """Record the mesh axes over which param's gradient must be summed by sync_grads."""
    setattr(param, GRAD_SYNC_ATTRIBUTE, tuple(axes))


def sync_grads(module: torch.nn.Module, mesh) -> None:
    """Sum every gradient of module over its parameter's axes (in place). Collective: every rank of
    the mesh calls it after the same backward. A parameter without a gradient gets zeros first,
    so every rank contributes the same buckets."""
    if mesh is None or mesh.size(REPLICATED) == 1:
        return
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
        total = shardops.psum("N -> N", flat, mesh, axes=axes)
        for p, part in zip(params, total.split([p.numel() for p in params])):
            p.grad.copy_(part.view_as(p.grad))
