"""The fused layer's stage functions hand their work to the Triton kernels when
kernels.available() says so. On CPU this forces that answer for float32 tensors and runs
the whole layer, forward and backward, through the kernels in Triton's interpreter."""
import pytest
import torch

import shardmoe
from shardmoe import kernels
from shardmoe.moe.reference import reference_forward_backward

pytestmark = pytest.mark.skipif(not kernels.triton_importable(),
                                reason="triton cannot be imported; install triton==3.9.0 to run the kernel tests")


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """kernels.available() answers True for float32 tensors and counts how often it did."""
    calls = []

    def available(tensor):
        calls.append(tensor.dtype)
        return tensor.dtype == torch.float32

    monkeypatch.setattr(kernels, "available", available)
    return calls


@pytest.mark.parametrize("options", [
    dict(expert="glu", activation="silu", capacity_factor=0.75, aux_loss_coef=0.1),
    dict(expert="mlp", activation="gelu", output_activation="gelu_tanh", bias=True, z_loss_coef=0.1),
])
def test_fused_layer_through_kernels_matches_float64_reference(kernels_on_cpu, options):
    torch.manual_seed(0)
    layer64 = shardmoe.MoE(40, 24, 6, 2, dtype=torch.float64, **options)
    with torch.no_grad():
        for p in layer64.parameters():
            p.normal_(0, 0.3)
    layer = shardmoe.MoE(40, 24, 6, 2, **options)
    layer.load_state_dict({k: v.float() for k, v in layer64.state_dict().items()})
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(25, 40, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(25, 40, generator=gen, dtype=torch.float64)

    x32 = x.float().requires_grad_()
    out = layer(x32)
    torch.autograd.backward([out, layer.aux_loss], [grad_out.float(), torch.ones_like(layer.aux_loss)])
    assert kernels_on_cpu, "no stage asked for the kernels"

    params64 = {k: v.detach() for k, v in layer64.named_parameters()}
    ref_out, _, ref_grads = reference_forward_backward(x, params64, layer64.config, grad_out)

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    assert rel(out, ref_out) < 1e-5
    assert rel(x32.grad, ref_grads["x"]) < 1e-5
    for name, p in layer.named_parameters():
        assert rel(p.grad, ref_grads[name]) < 1e-5, name
