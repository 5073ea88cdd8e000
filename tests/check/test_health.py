"""Gradient health: norms, flags and the printed table."""
import math

import pytest
import torch

from shardmoe.check.health import EXPLODING, MISSING, OK, VANISHING, gradient_health


def param_with_grad(shape, grad):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = None if grad is None else torch.as_tensor(grad, dtype=torch.float32).reshape(shape)
    return p


def test_norms_and_statuses():
    params = [
        ("healthy", param_with_grad((2,), [3.0, 4.0])),
        ("exploding", param_with_grad((2, 2), [300.0, 0.0, 0.0, 400.0])),
        ("vanishing", param_with_grad((1,), [1e-9])),
        ("zero", param_with_grad((3,), [0.0, 0.0, 0.0])),
        ("inf", param_with_grad((2,), [1.0, math.inf])),
        ("nan", param_with_grad((2,), [1.0, math.nan])),
        ("unused", param_with_grad((2,), None)),
    ]
    report = gradient_health(params)
    by_name = {e.name: e for e in report.entries}
    assert by_name["healthy"].norm == pytest.approx(5.0) and by_name["healthy"].max_abs == 4.0
    assert by_name["exploding"].norm == pytest.approx(500.0)
    expected = {"healthy": OK, "exploding": EXPLODING, "vanishing": VANISHING, "zero": VANISHING,
                "inf": EXPLODING, "nan": EXPLODING, "unused": MISSING}
    assert {n: e.status for n, e in by_name.items()} == expected
    assert [e.name for e in report.flagged] == [n for n in expected if n != "healthy"]
    assert not report.healthy


def test_total_norm_matches_torch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model(torch.randn(7, 5)).square().sum().backward()
    report = gradient_health(model.named_parameters())
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert report.healthy and report.total_norm == pytest.approx(expected, rel=1e-6)


def test_thresholds_are_configurable_and_frozen_parameters_skipped():
    frozen = param_with_grad((1,), [1e-12]).requires_grad_(False)
    params = [("w", param_with_grad((1,), [2.0])), ("frozen", frozen)]
    assert gradient_health(params).healthy
    assert [e.name for e in gradient_health(params).entries] == ["w"]
    assert gradient_health(params, explode_threshold=1.0).entries[0].status == EXPLODING
    assert gradient_health(params, vanish_threshold=3.0, explode_threshold=10.0).entries[0].status == VANISHING
    with pytest.raises(ValueError, match="vanish_threshold"):
        gradient_health(params, explode_threshold=1e-8)


def test_bf16_gradient_norm_does_not_overflow():
    """Squares of 1e20 overflow bf16/fp32 sums; the norm is accumulated in float64."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    p.grad = torch.full((4,), 1e20, dtype=torch.bfloat16)
    entry = gradient_health([("p", p)], explode_threshold=1e30).entries[0]
    assert entry.norm == pytest.approx(2 * p.grad[0].item(), rel=1e-6) and entry.status == OK


def test_table_lists_every_parameter_and_flag():
    params = [("layer.weight", param_with_grad((2, 3), [1.0] * 6)), ("layer.bias", param_with_grad((3,), [0.0] * 3))]
    table = gradient_health(params).table()
    lines = table.splitlines()
    assert lines[0].split() == ["parameter", "shape", "grad", "norm", "max", "|grad|", "status"]
    assert lines[2].split()[:2] == ["layer.weight", "2x3"] and lines[2].endswith(OK)
    assert lines[3].split()[:2] == ["layer.bias", "3"] and lines[3].endswith(VANISHING)
    assert "1 of 2 flagged" in lines[-1]
