"""The MoE layer versus the float64 reference: output, aux loss, stats and every gradient.

Relative error of a tensor a against its reference b:

    rel(a, b) = max|a - b| / max(max|b|, SCALE_FLOOR)     (over all elements of the tensor)

one number per tensor, measured against the tensor's own scale, so it is
independent of how many elements a tensor has; an empty tensor has error 0.
The floor exists for tensors that are zero in exact arithmetic: the gradient of
an expert that received no tokens, or the gate gradient when k = 1 with
renormalisation (every combine weight is identically 1). A float64 autograd
computes those as exact zeros or as +-1e-17 round-off, and dividing by that
would measure noise. The check's inputs are O(1) by construction (inputs.py),
so every tensor that is not degenerate has max|b| >= ~0.05 and the floor never
touches it.

The loss differentiated on both sides is L = sum(y * grad_out) + aux_loss with
a random grad_out, so every gradient is a random projection of the Jacobian.
Inputs are drawn in float64, rounded to the dtype under test, and the
reference runs in float64 on those same rounded values: what is measured is
the layer's own error, not the rounding of its inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardmoe.check.cases import CheckCase
from shardmoe.check.inputs import CaseInputs, make_inputs
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.reference import reference_forward_backward, reference_routing

# Worst relative error allowed per tensor, by the dtype the layer computes in.
# float64: the layer and the reference differ only in summation order (<= 1.8e-14 measured);
# 1e-10 leaves room for error growth yet catches any missing term, which is O(1).
# float32 (eps 1.2e-7) and bfloat16 (eps 7.8e-3) are measured against float64: a few
# GEMMs and activations in a row, each rounding once, then sums that cancel (the gate
# gradient). Measured over the matrix: the layer in fp32 stays below 9.3e-7, and
# a plain bf16 autograd run of the reference below 1.64e-2 (docs/checking.md gives the
# script). The bounds are ~80 and ~2.5 epsilons.
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
SCALE_FLOOR = 1e-3


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = SCALE_FLOOR) -> float:
    """max|actual - expected| / max(max|expected|, floor) in float64 (see the module docstring)."""
    if expected.numel() == 0:
        return 0.0
    actual = actual.detach().to("cpu", torch.float64)
    expected = expected.detach().to("cpu", torch.float64)
    diff = (actual - expected).abs().max().item()
    return diff / max(expected.abs().max().item(), floor)


@dataclass
class CaseResult:
    """Errors of one case at one dtype.

    errors: tensor name -> relative error; "output", "aux_loss", "x" (input
    gradient) and the parameter names (their gradients).
    problems: mismatches that are not a tolerance matter (stats, shapes, dtypes).
    """

    case: CheckCase
    dtype: torch.dtype
    tolerance: float
    errors: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def worst(self) -> tuple[str, float]:
        """(tensor name, error) of the largest error; nan errors count as the largest."""
        def key(item):
            return float("inf") if item[1] != item[1] else item[1]
        return max(self.errors.items(), key=key, default=("-", 0.0))

    @property
    def passed(self) -> bool:
        # `not err > tol` would let nan through; `err <= tol` does not.
        return not self.problems and all(err <= self.tolerance for err in self.errors.values())


def build_layer(config: MoEConfig, dtype: torch.dtype, device="cpu"):
    """A shardmoe.MoE built from `config` (looked up at call time, so tests can substitute it)."""
    import shardmoe

    from shardmoe.moe.layer import ACTIVATION_OPTIONS, ROUTER_OPTIONS, SHARED_OPTIONS

    c = config
    return shardmoe.MoE(
        c.hidden_size, c.ffn_size, c.num_experts, c.top_k, expert=c.expert, activation=c.activation,
        output_activation=c.output_activation, bias=c.bias, renormalize=c.renormalize,
        capacity_factor=c.capacity_factor, aux_loss_coef=c.aux_loss_coef, z_loss_coef=c.z_loss_coef,
        dtype=dtype, device=device,
        **{name: getattr(c, name) for name in ROUTER_OPTIONS + ACTIVATION_OPTIONS + SHARED_OPTIONS},
    )


def run_layer(config: MoEConfig, inputs: CaseInputs, device="cpu"):
    """Forward and backward of the MoE layer on `inputs`: (layer, y, x.grad).

    The layer holds the parameter gradients of L = sum(y * grad_out) + aux_loss."""
    layer = build_layer(config, inputs.x.dtype, device)
    with torch.no_grad():
        for name, value in inputs.params.items():
            getattr(layer, name).copy_(value)
        if inputs.correction_bias is not None:
            layer.correction_bias.copy_(inputs.correction_bias)
    x = inputs.x.to(device).requires_grad_(True)
    y = layer(x)
    # the aux loss's gradient rides on y's backward (layer.aux_loss_scale = 1): dL/d(aux_loss) = 1
    y.backward(inputs.grad_out.to(device))
    return layer, y, x.grad


def _stats_problems(layer, case: CheckCase, inputs64: CaseInputs) -> list[str]:
    """Compare the layer's routing statistics with the reference routing's."""
    routing = reference_routing(inputs64.x, inputs64.params["gate_weight"], case.config,
                                inputs64.params.get("gate_bias"), inputs64.correction_bias)
    expected = {"tokens_per_expert": routing.tokens_per_expert.tolist(), "dropped_tokens": routing.dropped_pairs}
    problems = []
    for key, want in expected.items():
        got = layer.stats.get(key)
        got = got.tolist() if isinstance(got, torch.Tensor) else got
        if got != want:
            problems.append(f"stats[{key!r}] = {got}, reference {want}")
    if case.empty_expert is not None and expected["tokens_per_expert"][case.empty_expert] != 0:
        problems.append(f"expert {case.empty_expert} was meant to receive no tokens")
    return problems


def compare_with_reference(case: CheckCase, dtype: torch.dtype = torch.float64, device="cpu") -> CaseResult:
    """Run shardmoe.MoE in `dtype` on the case's inputs and measure it against float64."""
    result = CaseResult(case, dtype, TOLERANCES[dtype])
    inputs = make_inputs(case, dtype)
    inputs64 = inputs.to(torch.float64)
    ref_out, ref_aux, ref_grads = reference_forward_backward(inputs64.x, inputs64.params, case.config,
                                                             inputs64.grad_out, inputs64.correction_bias)
    layer, y, x_grad = run_layer(case.config, inputs, device)

    if y.shape != inputs.x.shape or y.dtype != dtype:
        result.problems.append(f"output is {tuple(y.shape)} {y.dtype}, expected {tuple(inputs.x.shape)} {dtype}")
    result.errors["output"] = relative_error(y, ref_out)
    result.errors["aux_loss"] = relative_error(layer.aux_loss, ref_aux)
    # A gradient autograd never produced (None) is a zero gradient.
    layer_grads = {"x": x_grad, **{name: getattr(layer, name).grad for name in inputs.params}}
    for name, ref in ref_grads.items():
        got = layer_grads[name]
        result.errors[name] = relative_error(torch.zeros_like(ref) if got is None else got, ref)
    result.problems += _stats_problems(layer, case, inputs64)
    return result
