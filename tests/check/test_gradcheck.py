"""Finite differences against the MoE layer's explicit backward."""
import pytest
import torch

import shardmoe
from shardmoe.check.cases import gradcheck_cases
from shardmoe.check.command import single_threaded
from shardmoe.check.gradcheck import layer_gradcheck


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with single_threaded():
        yield


@pytest.mark.parametrize("case", gradcheck_cases(), ids=lambda c: c.name)
def test_backward_matches_finite_differences(case):
    result = layer_gradcheck(case)
    assert result.passed, result.message


class _ScaledBackward(torch.autograd.Function):
    """Identity forward, backward off by 0.1%: a defect far below what a loose check would see."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.001


class _WrongBackward(shardmoe.MoE):
    def forward(self, x):
        return _ScaledBackward.apply(super().forward(x))


def test_gradcheck_catches_a_wrong_backward(monkeypatch):
    monkeypatch.setattr(shardmoe, "MoE", _WrongBackward)
    result = layer_gradcheck(gradcheck_cases()[0])
    assert not result.passed and "Jacobian mismatch" in result.message
