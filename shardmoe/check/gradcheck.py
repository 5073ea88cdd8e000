"""Finite-difference check of the MoE layer's explicit backward (torch.autograd.gradcheck).

The layer is viewed as a function of all its inputs,

    f(x, gate_weight, *expert params) = (y, aux_loss),

and torch.autograd.gradcheck compares, in float64, the Jacobian its backward
implies (one vector-Jacobian product per output element) with central
differences (f(v + eps e_i) - f(v - eps e_i)) / (2 eps), column by column.
With eps = 1e-6 the truncation error is O(eps^2 f''') ~ 1e-12 and the
cancellation error O(1e-16 / eps) ~ 1e-10, hence atol 1e-7 and rtol 1e-6.

Unlike the reference comparison this needs no second implementation, only a
smooth neighbourhood: inputs come from inputs.make_inputs, which keeps every
top-k tie and relu kink further than the step away.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.gradcheck import GradcheckError, gradcheck

from shardmoe.check.cases import CheckCase
from shardmoe.check.compare import build_layer
from shardmoe.check.inputs import make_inputs

EPS, ATOL, RTOL = 1e-6, 1e-7, 1e-6


@dataclass
class GradcheckResult:
    case: CheckCase
    passed: bool
    message: str  # gradcheck's explanation when it failed, "" otherwise


def layer_gradcheck(case: CheckCase) -> GradcheckResult:
    """gradcheck of shardmoe.MoE (float64) on the case's inputs, wrt x and every parameter."""
    layer = build_layer(case.config, torch.float64)
    # the Jacobian of each output on its own: the aux loss as an output, not riding on y's backward
    layer.aux_loss_scale = None
    inputs = make_inputs(case, torch.float64)
    names = list(inputs.params)

    def layer_function(x, *params):
        y = torch.func.functional_call(layer, dict(zip(names, params)), (x,))
        return y, layer.aux_loss

    leaves = [inputs.x] + [inputs.params[n] for n in names]
    leaves = [t.clone().requires_grad_(True) for t in leaves]
    try:
        passed = gradcheck(layer_function, leaves, eps=EPS, atol=ATOL, rtol=RTOL)
        return GradcheckResult(case, passed, "")
    except GradcheckError as err:
        return GradcheckResult(case, False, str(err))
