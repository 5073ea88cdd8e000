"""shardmoe.settings: one object for the implementation switches, read from the environment once,
overridden for a block."""
import subprocess
import sys

import pytest
import torch

import shardmoe
from shardmoe import settings
from shardmoe.moe import cpu


def test_environment_is_read_at_import():
    """A variable set to 0 turns its switch off, any other value on; an unset one keeps its default
    (on for the implementations, off for the test switch force_kernels)."""
    # the module alone (it imports only the standard library), loaded from its file in a fresh
    # interpreter: the package's torch import would take seconds and read nothing more
    code = ("import importlib.util as u, sys; spec = u.spec_from_file_location('settings', " + repr(settings.__file__)
            + "); m = sys.modules['settings'] = u.module_from_spec(spec); spec.loader.exec_module(m); S = m.SETTINGS; "
            "print(S.kernels, S.experts_mm, S.fused_elementwise, S.autotune, S.force_kernels)")
    for env, want in (({"SHARDMOE_KERNELS": "0", "SHARDMOE_FUSED_ELEMENTWISE": "0", "SHARDMOE_AUTOTUNE": "0"},
                       ["False", "True", "False", "False", "False"]),
                      ({"SHARDMOE_FORCE_KERNELS": "1", "SHARDMOE_EXPERTS_MM": ""},
                       ["True", "True", "True", "True", "True"])):
        out = subprocess.run([sys.executable, "-c", code], env={**env, "PATH": ""}, capture_output=True, text=True,
                             check=True).stdout
        assert out.split() == want, env


def test_override_restores_on_error_and_names_bad_arguments():
    before = settings.SETTINGS.fused_elementwise
    with pytest.raises(KeyError):
        with settings.override(fused_elementwise=not before):
            assert settings.SETTINGS.fused_elementwise is (not before)
            raise KeyError("inside")
    assert settings.SETTINGS.fused_elementwise is before
    with pytest.raises(ValueError, match=r"override: expected settings among kernels, experts_mm, fused_elementwise, "
                                         r"autotune, force_kernels, got \['triton'\]"):
        with settings.override(triton=False):
            pass
    with pytest.raises(ValueError, match="override: expected bool values, got {'kernels': 0}"):
        with settings.override(kernels=0):
            pass


def test_switching_the_cpu_passes_off_changes_the_path_not_the_result():
    torch.manual_seed(0)
    layer = shardmoe.MoE(16, 8, 4, 2)
    x = torch.randn(32, 16)
    with settings.override(fused_elementwise=False):
        assert not cpu.CpuOps.decide(x).elementwise
        off = layer(x)
    on = layer(x)
    torch.testing.assert_close(on, off, rtol=1e-6, atol=1e-6)


def test_autotune_off_leaves_each_kernel_its_first_config():
    """The autotuner's early prune (kernels/tuning.py) keeps every candidate, or the first one (here,
    without CUDA, no tuned config applies)."""
    from shardmoe.kernels.tuning import Prune

    candidates, prune = ["a", "b", "c"], Prune("kernel", ["O"])
    with settings.override(autotune=True):  # whatever SHARDMOE_AUTOTUNE says
        assert prune(candidates, {"O": 1}) == candidates
    with settings.override(autotune=False):
        assert prune(candidates, {"O": 1}) == ["a"]
