"""RMSNorm with a learned gain and an explicit backward.

    r[B L]     = (mean_M x[B L M]^2 + eps)^(-1/2)
    xhat       = x r
    y[B L M]   = xhat w[M]
backward, given dy:
    dw[M]      = sum_{B L} dy xhat
    dx[B L M]  = r (dy w - xhat mean_M(dy w xhat))

Computed in float32 for bf16/fp32 inputs (float64 for float64); y is cast back to x's dtype.
The gain is declared 'M/t/d' (split over both t and d). Both gradients are linear in dy, so the
backward may run on an incoming gradient that is still unreduced over t (a sum of partial
gradients from t-sharded heads): psum_scatter over t of dx and over t and d of dw then finish it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .residuals import check_backward_mode, compute_dtype, load_residuals, save_residuals

WEIGHT_SPEC = "M/t/d"


class RMSNormResiduals(NamedTuple):
    x: Tensor       # B L M, input dtype
    rstd: Tensor    # B L 1, compute dtype: r above
    weight: Tensor  # M


class RMSNormGrads(NamedTuple):
    weight: Tensor  # M


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, RMSNormResiduals]:
    """y[... M] = x r w with r = rsqrt(mean_M x^2 + eps)."""
    acc = compute_dtype(x.dtype)
    xc = x.to(acc)
    rstd = torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps)
    y = (xc * rstd * weight.to(acc)).to(x.dtype)
    return y, RMSNormResiduals(x, rstd, weight)


def rms_norm_backward(res: RMSNormResiduals, grad_y: Tensor) -> tuple[Tensor, RMSNormGrads]:
    """dx = r (dy w - xhat mean_M(dy w xhat)); dw = sum over tokens of dy xhat."""
    acc = res.rstd.dtype
    xhat = res.x.to(acc) * res.rstd
    g = grad_y.to(acc)
    grad_w = (g * xhat).reshape(-1, xhat.shape[-1]).sum(dim=0)
    gw = g * res.weight.to(acc)
    grad_x = res.rstd * (gw - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
    return grad_x.to(res.x.dtype), RMSNormGrads(grad_w.to(res.weight.dtype))


class RMSNormFunction(torch.autograd.Function):
    """autograd.Function whose backward is rms_norm_backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, res = rms_norm_forward(x, weight, eps)
        save_residuals(ctx, res)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        grad_x, grads = rms_norm_backward(load_residuals(ctx), grad_y)
        return grad_x, grads.weight, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, backward: str = "explicit") -> Tensor:
    """RMSNorm, differentiated by the explicit backward or by plain autograd."""
    if check_backward_mode(backward) == "explicit":
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_forward(x, weight, eps)[0]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with gain w[M] ('M/t/d'), initialised to ones."""

    SPECS = {"weight": WEIGHT_SPEC}

    def __init__(self, d_model: int, eps: float = 1e-5, *, backward: str = "explicit", dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.backward = check_backward_mode(backward)
        self.weight = nn.Parameter(torch.ones(d_model, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, backward=self.backward)
