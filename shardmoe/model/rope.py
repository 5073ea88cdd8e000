"""Rotary position embedding (RoPE), "rotate-half" layout as in Llama/Mixtral.

Head dim D is split in halves x = [x1, x2] (each D/2). For position p and pair index
i in [0, D/2): angle[p, i] = p theta^(-2i/D), and
    forward:  y1 = x1 cos - x2 sin,   y2 = x2 cos + x1 sin
    backward: the rotation is orthogonal, so dx = R^T dy is the rotation by -angle:
              dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin
Positions come from packed_layout and restart at 0 at every segment start. RoPE is elementwise
over the head axes, so a t-sharded head axis needs no communication.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .residuals import check_backward_mode, forward_autocast, load_residuals, save_residuals


class RopeTable(NamedTuple):
    cos: Tensor  # B L D/2, compute dtype
    sin: Tensor  # B L D/2, compute dtype


class RopeResiduals(NamedTuple):
    cos: Tensor  # B L D/2
    sin: Tensor  # B L D/2


class RopeGrads(NamedTuple):
    """RoPE has no weights."""


def rope_table(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> RopeTable:
    """cos/sin[B L D/2] of angle = position * theta^(-2i/D), computed in float64, stored in `dtype`."""
    if head_dim % 2:
        raise ValueError(f"head_dim: expected an even int, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    inv_freq = theta ** -exponents
    angle = positions.to(torch.float64)[..., None] * inv_freq
    return RopeTable(angle.cos().to(dtype), angle.sin().to(dtype))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x[B L <heads...> D]: broadcast the B L D/2 table over the head axes.
    shape = cos.shape[:2] + (1,) * (x.dim() - 3) + cos.shape[2:]
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_forward(x: Tensor, table: RopeTable) -> tuple[Tensor, RopeResiduals]:
    """Rotate x[B L <heads...> D] by its positions' angles."""
    return _rotate(x, table.cos, table.sin), RopeResiduals(table.cos, table.sin)


def rope_backward(res: RopeResiduals, grad_y: Tensor) -> tuple[Tensor, RopeGrads]:
    """dx = rotation of dy by the negated angles."""
    return _rotate(grad_y, res.cos, -res.sin), RopeGrads()


class RopeFunction(torch.autograd.Function):
    """autograd.Function whose backward is rope_backward (the table gets no gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        y, res = rope_forward(x, RopeTable(cos, sin))
        save_residuals(ctx, res)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        with forward_autocast(ctx):
            grad_x, _ = rope_backward(load_residuals(ctx), grad_y)
        return grad_x, None, None


def apply_rope(x: Tensor, table: RopeTable, backward: str = "explicit") -> Tensor:
    """RoPE, differentiated by the explicit backward or by plain autograd."""
    if check_backward_mode(backward) == "explicit":
        return RopeFunction.apply(x, table.cos, table.sin)
    return rope_forward(x, table)[0]
