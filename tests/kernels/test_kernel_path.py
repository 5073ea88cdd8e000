"""shardmoe.kernels.kernel_path: the one predicate that routes a layer to the kernels."""
import pytest
import torch

from shardmoe.kernels import KERNEL_ACTIVATIONS, available, kernel_path, triton_importable
from shardmoe.kernels.activations import activation_args
from shardmoe.moe.config import ACTIVATIONS, EXPERT_KINDS, GLU_ACTIVATIONS, MoEConfig
from shardmoe.settings import SETTINGS, override


def _config(**overrides):
    return MoEConfig(**{"hidden_size": 8, "ffn_size": 16, "num_experts": 4, "top_k": 2, **overrides})


def test_cpu_tensors_refused_unless_forced():
    """CPU tensors reach the kernels (Triton's interpreter) only under the force_kernels setting."""
    x = torch.zeros(3, 8)
    assert kernel_path(_config(), x) is False and available(x) is False
    with override(force_kernels=True):
        assert kernel_path(_config(), x) is triton_importable()
        assert available(x) is triton_importable()
    assert kernel_path(_config(), x) is False and available(x) is False


@pytest.mark.parametrize("expert", EXPERT_KINDS)
def test_kernels_have_a_branch_for_every_activation_the_layer_has(expert):
    """kernel_path takes every layer MoEConfig accepts, so the kernels must have every activation it
    accepts: one added to the config without a kernel branch fails here, not on a GPU."""
    assert KERNEL_ACTIVATIONS == ACTIVATIONS
    for name in GLU_ACTIVATIONS if expert == "glu" else ACTIVATIONS:
        config = _config(expert=expert, activation=name)
        args = activation_args(config.expert_activation, glu=expert == "glu")
        assert args["ACT"] == name
        activation_args(config.output_activation, glu=False)


def test_refusals_fall_back_to_torch(monkeypatch):
    x = torch.zeros(3, 8)
    with override(force_kernels=True):
        assert kernel_path(_config(), x.double()) is False  # not a kernel dtype
        assert kernel_path(_config(), x.half()) is False
        monkeypatch.setattr(SETTINGS, "kernels", False)
        assert kernel_path(_config(), x) is False


def test_wide_experts_go_to_the_torch_path_unless_forced(monkeypatch):
    """On CUDA the kernels take expert GEMMs up to KERNEL_MAX_FFN wide (measured: past it cuBLAS won);
    the force_kernels setting takes every width (the GPU bench times the kernels at the Mixtral shape)."""
    import shardmoe.kernels as kernels

    x = torch.zeros(3, 8)
    monkeypatch.setattr(kernels, "available", lambda t: True)  # as for a CUDA tensor
    assert kernel_path(_config(ffn_size=kernels.KERNEL_MAX_FFN), x) is True
    assert kernel_path(_config(ffn_size=kernels.KERNEL_MAX_FFN + 1), x) is False
    # under expert tensor parallelism a rank's GEMMs are F/t wide: that width is the one measured
    wide = _config(ffn_size=4 * kernels.KERNEL_MAX_FFN)
    assert kernel_path(wide, x, expert_width=kernels.KERNEL_MAX_FFN) is True
    assert kernel_path(wide, x, expert_width=kernels.KERNEL_MAX_FFN + 1) is False
    with override(force_kernels=True):
        assert kernel_path(_config(ffn_size=kernels.KERNEL_MAX_FFN + 1), x) is True
