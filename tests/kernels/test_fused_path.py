"""shardmoe.kernels.fused_path: the one predicate that routes a layer to the kernels."""
import pytest
import torch

from shardmoe.kernels import available, force_kernel_path, fused_path
from shardmoe.moe.config import MoEConfig
from shardmoe.settings import SETTINGS


def _config(**overrides):
    return MoEConfig(**{"hidden_size": 8, "ffn_size": 16, "num_experts": 4, "top_k": 2, **overrides})


def test_cpu_tensors_refused_unless_forced():
    x = torch.zeros(3, 8)
    assert fused_path(_config(), x) is False
    with force_kernel_path():
        assert fused_path(_config(), x) is True
        assert available(x) is False  # the switch reaches the predicate only
    assert fused_path(_config(), x) is False


@pytest.mark.parametrize("overrides", [
    {"expert": "glu", "capacity_factor": 1.0}, {"expert": "mlp", "bias": True}, {"expert": "glu", "bias": True},
    {"expert": "glu", "activation": "clamped_swiglu", "swiglu_limit": 3.0, "bias": True},
    {"expert": "glu", "shared_ffn_size": 8, "shared_gate": True}, {"expert": "mlp", "shared_ffn_size": 8},
], ids=["glu-capacity", "mlp-bias", "glu-bias", "clamped-swiglu-bias", "glu-shared-gated", "mlp-shared"])
def test_every_expert_kind_accepted(overrides):
    """Every expert kind the torch path runs: biases, the clamped SwiGLU, shared experts (on torch beside)."""
    with force_kernel_path():
        assert fused_path(_config(**overrides), torch.zeros(3, 8)) is True
        assert fused_path(_config(**overrides), torch.zeros(3, 8, dtype=torch.bfloat16)) is True


def test_refusals_fall_back_to_torch(monkeypatch):
    x = torch.zeros(3, 8)
    with force_kernel_path():
        assert fused_path(_config(), x.double()) is False  # not a kernel dtype
        assert fused_path(_config(), x.half()) is False
        monkeypatch.setattr(SETTINGS, "kernels", False)
        assert fused_path(_config(), x) is False
