"""Elementwise activations and their backward, grad * act'(z), in one fused pass.

  relu       act = max(z, 0)                       act' = [z > 0]
  gelu       act = z Phi(z)                        act' = Phi(z) + z phi(z)
  gelu_tanh  act = z (1 + tanh u) / 2,             act' = (1 + tanh u) / 2
             u = c (z + 0.044715 z^3), c = sqrt(2/pi)     + z (1 - tanh^2 u) c (1 + 3*0.044715 z^2) / 2
  silu       act = z sigmoid(z)                    act' = sigmoid(z) (1 + z (1 - sigmoid(z)))
  identity   act = z                               act' = 1

Phi and phi are the standard normal CDF and density. The backward multiplies the incoming
gradient by act'(z) before any GEMM sees it (FlashMoE's fGETGrad order). It runs on aten's
fused activation-backward kernels, which evaluate these closed forms (in float32 for bf16
operands, rounding once): one pass instead of the five or six a hand-written formula takes,
and no autograd graph. tests/moe/test_activations.py checks them against autograd in float64.

One glu activation is not of the form act(hg) * hu, so it is not a name but a ClampedSwiGLU
object (GPT-OSS's, MoEConfig activation="clamped_swiglu"): the stage functions of
shardmoe/moe/experts.py take `activation` as either.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's clamped SwiGLU on the halves hg, hu [N, F] of h = [hg | hu], constants limit L, alpha:

      gc = min(hg, L);  uc = clamp(hu, -L, L);  f(gc) = gc sigmoid(alpha gc)
      a  = (uc + 1) f(gc)
      da/dhg = (uc + 1) f'(gc) [hg <= L],   f'(g) = s (1 + alpha g (1 - s)),  s = sigmoid(alpha g)
      da/dhu = f(gc) [-L <= hu <= L]

    The clamp passes its gradient where the input is in the closed range, at hg == L and hu == +-L
    included: torch.clamp's autograd, which GPT-OSS's reference calls. (torch.minimum would give half
    the gradient at hg == L, its convention for ties between two inputs; L is a constant here.)"""

    limit: float
    alpha: float

    def gate(self, hg: torch.Tensor) -> torch.Tensor:
        """f(min(hg, L)), the factor that stands where act(hg) stands in the other glus."""
        gc = hg.clamp(max=self.limit)
        return gc * torch.sigmoid(self.alpha * gc)

    def forward(self, hg: torch.Tensor, hu: torch.Tensor, out: torch.Tensor | None = None):
        """(a [N, F], f(gc) [N, F]), a written into `out` when one is given."""
        act_gate = self.gate(hg)
        return torch.mul(hu.clamp(-self.limit, self.limit).add_(1), act_gate, out=out), act_gate

    def backward(self, grad_a: torch.Tensor, hg: torch.Tensor, hu: torch.Tensor, act_gate: torch.Tensor,
                 grad_gate: torch.Tensor, grad_up: torch.Tensor) -> None:
        """grad_gate = dA * da/dhg and grad_up = dA * da/dhu, written in place ([N, F] each)."""
        gc = hg.clamp(max=self.limit)
        s = torch.sigmoid(self.alpha * gc)
        slope = s * (1 + self.alpha * gc * (1 - s))
        up_factor = hu.clamp(-self.limit, self.limit).add_(1)
        torch.mul(grad_a * up_factor, slope.masked_fill_(hg > self.limit, 0), out=grad_gate)
        torch.mul(grad_a, act_gate, out=grad_up).masked_fill_(hu.abs() > self.limit, 0)
