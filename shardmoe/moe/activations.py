"""Elementwise activations and their exact derivatives.

The fused backward never differentiates through autograd, so every activation
comes with a closed-form derivative act'(z):

  relu       act = max(z, 0)                       act' = [z > 0]
  gelu       act = z Phi(z)                        act' = Phi(z) + z phi(z)
  gelu_tanh  act = z (1 + tanh u) / 2,             act' = (1 + tanh u) / 2
             u = c (z + 0.044715 z^3), c = sqrt(2/pi)     + z (1 - tanh^2 u) c (1 + 3*0.044715 z^2) / 2
  silu       act = z sigmoid(z)                    act' = sigmoid(z) (1 + z (1 - sigmoid(z)))
  identity   act = z                               act' = 1

Phi and phi are the standard normal CDF and density.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_CUBIC = 0.044715


def activate(name: str, z: torch.Tensor) -> torch.Tensor:
    """act(z) for the activation called `name`."""
    if name == "relu":
        return F.relu(z)
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "silu":
        return F.silu(z)
    if name == "identity":
        return z
    raise ValueError(f"activation: expected relu, gelu, gelu_tanh, silu or identity, got {name!r}")


def activate_grad(name: str, z: torch.Tensor) -> torch.Tensor:
    """act'(z), the derivative of act at z, elementwise."""
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
        return cdf + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    if name == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_CUBIC * z * z * z))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_CUBIC * z * z)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    if name == "identity":
        return torch.ones_like(z)
    raise ValueError(f"activation: expected relu, gelu, gelu_tanh, silu or identity, got {name!r}")
