"""RMSNorm with a learned gain and an explicit backward.

    r[B L]     = (mean_M x[B L M]^2 + eps)^(-1/2)
    xhat       = x r
    y[B L M]   = xhat w[M]
backward, given dy:
    dw[M]      = sum_{B L} dy xhat
    dx[B L M]  = r (dy w - xhat mean_M(dy w xhat))

Computed in float32 for bf16/fp32 inputs (float64 for float64); y is cast back to x's dtype.

Sharded (docs/model.md "Layout"): x 'B/d L M/t' (the residual stream), gain 'M/t/d', y 'B/d L M'.
    forward:  x[B/d L M] = all_gather_t(x), w[M] = all_gather_{t,d}(w), then the formulas.
    backward: y feeds t-sharded heads, so dy arrives as a partial sum over t. Both gradients are
              linear in dy, so the formulas run on the partials and the sums happen in the duals:
              dx[B/d L M/t] = psum_scatter_t(dx), dw[M/t/d] = psum_scatter_{t,d}(dw).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from shardmoe.parallel import dtensors
from shardmoe.parallel.shardops import all_gather, einsum_unreduced, psum_scatter, unreduced

from .residuals import autograd_grads, check_backward_mode, compute_dtype, forward_autocast, load_residuals, save_residuals
from .sharding import local_shape

WEIGHT_SPEC = "M/t/d"


class RMSNormResiduals(NamedTuple):
    x: Tensor       # B L M, input dtype (gathered over t)
    rstd: Tensor    # B L 1, compute dtype: r above
    weight: Tensor  # M (gathered)
    mesh: object    # shardmoe.Mesh or None


class RMSNormGrads(NamedTuple):
    weight: Tensor  # M/t/d


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float, mesh=None) -> tuple[Tensor, RMSNormResiduals]:
    """y[... M] = x r w with r = rsqrt(mean_M x^2 + eps)."""
    x = all_gather("B/d L M/t -> B/d L M", x, mesh)
    weight = all_gather("M/t/d -> M", weight, mesh)
    acc = compute_dtype(x.dtype)
    xc = x.to(acc)
    rstd = torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps)
    y = (xc * rstd * weight.to(acc)).to(x.dtype)
    return y, RMSNormResiduals(x, rstd, weight, mesh)


def rms_norm_backward(res: RMSNormResiduals, grad_y: Tensor) -> tuple[Tensor, RMSNormGrads]:
    """dx = r (dy w - xhat mean_M(dy w xhat)); dw = sum over tokens of dy xhat."""
    acc = res.rstd.dtype
    xhat = res.x.to(acc) * res.rstd
    # y feeds t-sharded work, so dy arrives as this rank's term of a sum over t (the convention).
    g = unreduced("B/d L M", grad_y.to(acc), "t")
    grad_w = einsum_unreduced("B/d L M, B/d L M -> M", g, xhat)  # adds d: it contracts B/d
    # dx is linear in dy, elementwise: computed on the partial, it is a partial over t as well.
    gw = g.partial * res.weight.to(acc)
    grad_x = res.rstd * (gw - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
    grad_x = psum_scatter("B/d L M -> B/d L M/t", unreduced("B/d L M", grad_x.to(res.x.dtype), "t"), res.mesh)
    # The gain's gradient is tiny: sum it over ranks in the compute dtype, then cast.
    grad_w = psum_scatter("M -> M/t/d", grad_w, res.mesh).to(res.weight.dtype)
    return grad_x, RMSNormGrads(grad_w)


class RMSNormFunction(torch.autograd.Function):
    """autograd.Function whose backward is rms_norm_backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, mesh) -> Tensor:
        y, res = rms_norm_forward(x, weight, eps, mesh)
        save_residuals(ctx, res)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        with forward_autocast(ctx):
            grad_x, grads = rms_norm_backward(load_residuals(ctx), grad_y)
        return autograd_grads("RMSNormFunction.backward", grad_x, grads.weight, None, None)


def rms_norm(x: Tensor, weight: Tensor, eps: float, mesh=None, backward: str = "explicit") -> Tensor:
    """RMSNorm, differentiated by the explicit backward or by plain autograd."""
    if check_backward_mode(backward) == "explicit":
        return RMSNormFunction.apply(x, weight, eps, mesh)
    return rms_norm_forward(x, weight, eps, mesh)[0]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with gain w[M] ('M/t/d'), initialised to ones.

    With a mesh the parameter is a DTensor of the gains whose local tensor is this rank's block
    [M/t/d], and the input is x[B/d L M/t].
    """

    SPECS = {"weight": WEIGHT_SPEC}

    def __init__(self, d_model: int, eps: float = 1e-5, *, mesh=None, backward: str = "explicit",
                 dtype=None, device=None):
        super().__init__()
        self.eps, self.mesh = eps, mesh
        self.backward = check_backward_mode(backward)
        shape = local_shape(WEIGHT_SPEC, (d_model,), mesh)
        self.weight = nn.Parameter(dtensors.parameter(WEIGHT_SPEC, torch.ones(shape, dtype=dtype, device=device), mesh))

    def forward(self, x: Tensor) -> Tensor:
        """x[B/d L M/t] -> y[B/d L M]."""
        return rms_norm(x, dtensors.compute_view(self.weight), self.eps, self.mesh, backward=self.backward)
