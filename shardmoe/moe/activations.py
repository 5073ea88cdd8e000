"""Elementwise activations and their backward, grad * act'(z), in one fused pass.

  relu       act = max(z, 0)                       act' = [z > 0]
  gelu       act = z Phi(z)                        act' = Phi(z) + z phi(z)
  gelu_tanh  act = z (1 + tanh u) / 2,             act' = (1 + tanh u) / 2
             u = c (z + 0.044715 z^3), c = sqrt(2/pi)     + z (1 - tanh^2 u) c (1 + 3*0.044715 z^2) / 2
  silu       act = z sigmoid(z)                    act' = sigmoid(z) (1 + z (1 - sigmoid(z)))
  identity   act = z                               act' = 1

Phi and phi are the standard normal CDF and density. The backward multiplies the incoming
gradient by act'(z) before any GEMM sees it (the seeds' fGETGrad order). It runs on aten's
fused activation-backward kernels, which evaluate these closed forms (in float32 for bf16
operands, rounding once): one pass instead of the five or six a hand-written formula takes,
and no autograd graph. tests/moe/test_activations.py checks them against autograd in float64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_aten = torch.ops.aten


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


def activate_backward(name: str, grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """grad * act'(z), elementwise, for grad and z of one shape and dtype."""
    if name == "relu":
        return _aten.threshold_backward(grad, z, 0)
    if name == "gelu":
        return _aten.gelu_backward(grad, z)
    if name == "gelu_tanh":
        return _aten.gelu_backward(grad, z, approximate="tanh")
    if name == "silu":
        return _aten.silu_backward(grad, z)
    if name == "identity":
        return grad
    raise ValueError(f"activation: expected relu, gelu, gelu_tanh, silu or identity, got {name!r}")
