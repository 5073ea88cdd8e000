"""shardmoe.kernels.available: which tensors the stage functions may hand to the kernels."""
import pytest
import torch

from shardmoe.kernels import available, triton_importable
from shardmoe.settings import SETTINGS

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_tensors_stay_on_torch(dtype):
    """Even with triton installed and TRITON_INTERPRET=1 (this suite's setting on CPU)."""
    assert available(torch.zeros(2, dtype=dtype)) is False


@needs_cuda
def test_cuda_kernel_dtypes_are_available(monkeypatch):
    monkeypatch.setattr(SETTINGS, "kernels", True)
    assert available(torch.zeros(2, device="cuda")) is triton_importable()
    assert available(torch.zeros(2, device="cuda", dtype=torch.bfloat16)) is triton_importable()
    assert available(torch.zeros(2, device="cuda", dtype=torch.float64)) is False


@needs_cuda
def test_environment_switch_turns_kernels_off(monkeypatch):
    monkeypatch.setattr(SETTINGS, "kernels", False)  # SHARDMOE_KERNELS=0 at import
    assert available(torch.zeros(2, device="cuda")) is False
