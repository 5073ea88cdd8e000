"""Shared helpers for the dense-layer tests: relative error and packed inputs."""
import pytest
import torch


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (absolute when expected is all zeros)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


@pytest.fixture
def rel_err():
    return _relative_error


@pytest.fixture
def packed_starts():
    """is_seq_start[2 11]: row 0 holds 3 segments (one of length 1), row 1 starts mid-document."""
    starts = torch.zeros(2, 11, dtype=torch.bool)
    starts[0, [0, 4, 5]] = True
    starts[1, [3, 9]] = True
    return starts
