"""shardmoe.kernels.tuning: every autotuned kernel prunes through the autotune setting."""
import importlib
import pkgutil

import pytest

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

from triton.runtime.autotuner import Autotuner  # noqa: E402

import shardmoe.kernels  # noqa: E402
from shardmoe.kernels.tuning import first_unless_tuning  # noqa: E402


def test_every_autotuned_kernel_prunes_through_the_setting():
    """A kernel decorated without prune_configs_by=PRUNE would compile every config at every check
    shape (the first GPU run spent about 60 s per parity case that way)."""
    found = {}
    for name in (m.name for m in pkgutil.iter_modules(shardmoe.kernels.__path__)):
        module = importlib.import_module(f"shardmoe.kernels.{name}")
        found.update({f"{name}.{attr}": obj for attr, obj in vars(module).items() if isinstance(obj, Autotuner)})
    assert {"grad_gemm.grad_gemm_kernel", "weight_grad.weight_grad_kernel"} <= set(found), sorted(found)
    assert all(tuner.early_config_prune is first_unless_tuning for tuner in found.values()), sorted(found)
