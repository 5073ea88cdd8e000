"""Plumbing shared by the dense layers' autograd.Function wrappers.

Every layer returns its residuals (what its backward needs) as a NamedTuple. Inside an
autograd.Function the tensor fields go through ctx.save_for_backward, so autograd's checks
for in-place modification of saved tensors still apply; the other fields (eps, scale, ...)
ride on ctx as plain attributes, and so does the forward's autocast state, which the backward
runs under again (forward_autocast): under torch.autocast the forward's GEMMs ran in its dtype
and saved such tensors, so the backward's GEMMs need the same casts (as torch.amp.custom_bwd).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from shardmoe.moe.precision import autocast_available
from shardmoe.parallel.shardops import Unreduced, UnreducedError

BACKWARD_MODES = ("explicit", "autograd")


def check_backward_mode(mode: str) -> str:
    """Validate a layer's `backward` option: 'explicit' (hand-written) or 'autograd'."""
    if mode not in BACKWARD_MODES:
        raise ValueError(f"backward: expected one of {', '.join(BACKWARD_MODES)}, got {mode!r}")
    return mode


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for reductions, softmax and norms: float64 stays float64, anything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def save_residuals(ctx, residuals: NamedTuple) -> None:
    """Stash a residuals NamedTuple on an autograd.Function ctx."""
    fields = list(residuals)
    tensor_slots = [i for i, v in enumerate(fields) if isinstance(v, torch.Tensor)]
    ctx.save_for_backward(*(fields[i] for i in tensor_slots))
    ctx.autocast = autocast_state(fields[tensor_slots[0]].device.type if tensor_slots else "cpu")
    ctx.residual_type = type(residuals)
    ctx.tensor_slots = tensor_slots
    ctx.other_fields = [None if i in tensor_slots else v for i, v in enumerate(fields)]


def autograd_grads(function: str, *grads):
    """The gradients an autograd.Function's backward returns, checked to hold no Unreduced: one
    there means a psum or psum_scatter was skipped (autograd itself would only say "expected
    Variable or None")."""
    for i, grad in enumerate(grads):
        if isinstance(grad, Unreduced):
            raise UnreducedError(f"{function} returns gradient {i} as {grad!r}: reduce it with psum or "
                                 "psum_scatter first")
    return grads


def autocast_state(device: str) -> tuple[str, bool, torch.dtype | None]:
    """(device type, enabled, dtype) of autocast on `device` now (disabled where autocast has no such device)."""
    enabled = autocast_available(device) and torch.is_autocast_enabled(device)
    return device, enabled, torch.get_autocast_dtype(device) if enabled else None


def restore_autocast(state: tuple[str, bool, torch.dtype | None]):
    """torch.autocast in an autocast_state (nothing on a device autocast does not know, such as meta)."""
    device, enabled, dtype = state
    if not autocast_available(device):
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype, enabled=enabled)


def forward_autocast(ctx):
    """The autocast state the forward ran under (save_residuals), for the backward to run under."""
    return restore_autocast(ctx.autocast)


def load_residuals(ctx) -> NamedTuple:
    """Rebuild the residuals NamedTuple stashed by save_residuals."""
    fields = list(ctx.other_fields)
    for i, tensor in zip(ctx.tensor_slots, ctx.saved_tensors):
        fields[i] = tensor
    return ctx.residual_type(*fields)
