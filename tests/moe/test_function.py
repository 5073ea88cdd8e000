"""FusedMoE: explicit backward vs the independent float64 reference; what it saves."""
import pytest
import torch

import shardmoe
from shardmoe.moe.reference import reference_moe

CASES = [
    dict(expert="glu", activation="silu"),
    dict(expert="glu", activation="gelu_tanh", renormalize=False, capacity_factor=0.6, aux_loss_coef=0.1,
         z_loss_coef=0.01),
    dict(expert="mlp", bias=True, activation="gelu", output_activation="gelu_tanh"),
    dict(expert="mlp", bias=True, activation="relu", output_activation="silu", capacity_factor=1.0,
         aux_loss_coef=0.3, z_loss_coef=0.2),
]


def _layer(top_k=2, **kw):
    torch.manual_seed(0)
    layer = shardmoe.MoE(8, 6, 4, top_k, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


def _grads(out, aux, grad_out, inputs):
    return torch.autograd.grad((out * grad_out).sum() + aux, inputs)


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("top_k", [1, 3])
def test_fused_backward_equals_reference_float64(kw, top_k):
    layer = _layer(top_k, **kw)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(13, 8, generator=gen, dtype=torch.float64)
    params = dict(layer.named_parameters())
    out = layer(x)
    got = _grads(out, layer.aux_loss, grad_out, [x, *params.values()])
    ref_out, ref_aux = reference_moe(x, params, layer.config)
    want = _grads(ref_out, ref_aux, grad_out, [x, *params.values()])
    assert (out - ref_out).abs().max() <= 1e-10 * ref_out.abs().max()
    assert abs(layer.aux_loss.item() - ref_aux.item()) <= 1e-10 * max(abs(ref_aux.item()), 1e-300)
    for name, g, w in zip(["x", *params], got, want):
        # top_k=1 with renormalisation makes w == 1, so the gate gradient is exactly zero and the
        # reference carries only round-off: the bound floors the scale at 1e-3 (the inputs are O(1)).
        assert (g - w).abs().max() <= 1e-10 * max(w.abs().max(), 1e-3), name


def test_everything_saved_goes_through_save_for_backward():
    """Saved-tensor hooks see every saved tensor: x, routing state and h, and nothing of size [N, H]
    other than what the docstring lists (y is not saved)."""
    S, H, F, E, k = 64, 16, 32, 4, 2
    layer = shardmoe.MoE(H, F, E, k)
    x = torch.randn(S, H, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    shapes = sorted(tuple(t.shape) for t in saved if not isinstance(t, torch.nn.Parameter))
    params = {p.data_ptr() for p in layer.parameters()}
    activations = [t for t in saved if t.data_ptr() not in params]
    assert (S * k, 2 * F) in shapes and (S, H) in shapes
    assert (S * k, H) not in shapes
    bytes_per_token = sum(t.numel() * t.element_size() for t in activations) / S
    # x (H) + h (k 2F) floats, probs E + logsumexp 1 + top_prob k + weight k floats, top_idx k + row_pair k int64
    expected = 4 * (H + k * 2 * F) + 4 * (E + 1 + 2 * k) + 8 * 2 * k + 8 * 2 * E / S
    assert bytes_per_token == pytest.approx(expected)
    out.sum().backward()
    assert x.grad is not None
