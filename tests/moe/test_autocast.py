"""torch.autocast: the router computes in float32, the experts in the autocast dtype, parameter
gradients land in the parameters' dtype; outside autocast nothing changes.

The reference is the float64 autograd one on what autocast computes: x and the expert weights
rounded to bf16, the gate weight as it is (float32), so selection and weights match exactly and
the outputs and gradients to bf16 round-off of the expert GEMMs."""
import pytest
import torch

import shardmoe
from shardmoe.moe import precision
from shardmoe.moe.reference import reference_forward_backward, reference_routing

H, F, E, K = 16, 12, 6, 2
ROUTER_NAMES = ("gate_weight", "gate_bias")


def _layer(**options):
    torch.manual_seed(0)
    return shardmoe.MoE(H, F, E, K, aux_loss_coef=0.1, z_loss_coef=0.01, **options)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("options", [dict(), dict(expert="mlp", activation="gelu", bias=True, router_bias=True),
                                     dict(shared_ffn_size=8, shared_gate=True, seq_aux_loss_coef=0.2)],
                         ids=["glu", "mlp-bias-router-bias", "shared-seq"])
def test_router_in_float32_experts_in_bf16_gradients_in_float32(options):
    layer = _layer(**options)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, H, generator=gen, requires_grad=True)
    grad_out = torch.randn(3, 8, H, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(grad_out.bfloat16())
    assert y.dtype == torch.bfloat16 and layer.aux_loss.dtype == torch.float32
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())

    # what autocast computes, in float64: bf16-rounded x and experts, the float32 router as it is
    params = {n: (p.detach() if n in ROUTER_NAMES else p.detach().bfloat16()).double()
              for n, p in layer.named_parameters()}
    x64 = x.detach().bfloat16().double()
    routing = reference_routing(x64, params["gate_weight"], layer.config, params.get("gate_bias"))
    assert layer.stats["tokens_per_expert"].tolist() == routing.tokens_per_expert.tolist()
    ref_y, ref_aux, ref_grads = reference_forward_backward(x64, params, layer.config, grad_out.bfloat16().double())
    assert _rel(y, ref_y) <= 1e-2
    assert _rel(layer.aux_loss, ref_aux) <= 1e-6  # the router ran in float32 on the rounded x
    for name, p in layer.named_parameters():
        assert _rel(p.grad, ref_grads[name]) <= 3e-2, name
    assert _rel(x.grad, ref_grads["x"]) <= 3e-2


def test_a_linear_before_the_layer_under_autocast():
    """The usual model: an autocast nn.Linear hands the layer bf16 activations, its parameters are float32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), _layer())
    x = torch.randn(10, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    want = model(x)  # float32 without autocast: bf16 round-off apart, the same function
    assert _rel(y, want) <= 2e-2


def test_outside_autocast_nothing_is_cast_and_float64_is_never_autocast():
    layer = _layer()
    with pytest.raises(ValueError, match=r"x: expected dtype torch\.float32 \(the parameters' dtype\), got torch\.bfloat16"):
        layer(torch.randn(4, H).bfloat16())
    layer64 = _layer(dtype=torch.float64)
    x = torch.randn(4, H, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer64(x)
    assert y.dtype == torch.float64 and torch.equal(y, layer64(x))


def test_an_autocast_dtype_without_kernels_is_named(monkeypatch):
    """torch's CPU autocast itself refuses float32; a dtype that gets through (CUDA's float32 one, say)
    is named before any work."""
    layer = _layer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.float32)
        with pytest.raises(ValueError, match=r"torch\.autocast: expected dtype among torch\.bfloat16, torch\.float16 "
                                             r"for the MoE's expert GEMMs, got torch\.float32"):
            layer(torch.randn(4, H))
    assert layer.stats == {}


def test_cast_leaves_none_and_integer_tensors():
    ids = torch.arange(3)
    got = precision.cast((torch.ones(2), None, ids), torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and got[1] is None and got[2] is ids
    assert precision.cast((ids,), None)[0] is ids
