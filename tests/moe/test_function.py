"""The MoE operators (moe/function.py): explicit backward vs the independent float64 reference; what it saves; no double backward."""
import re

import pytest
import torch

import shardmoe
from shardmoe.moe.reference import reference_moe

CASES = [
    dict(expert="glu", activation="silu"),
    dict(expert="glu", activation="gelu_tanh", renormalize=False, capacity_factor=0.6, aux_loss_coef=0.1,
         z_loss_coef=0.01),
    dict(expert="glu", bias=True, activation="silu"),
    dict(expert="glu", bias=True, activation="gelu", renormalize=False, capacity_factor=0.6, aux_loss_coef=0.1),
    dict(expert="mlp", bias=True, activation="gelu", output_activation="gelu_tanh"),
    dict(expert="mlp", bias=True, activation="relu", output_activation="silu", capacity_factor=1.0,
         aux_loss_coef=0.3, z_loss_coef=0.2),
]


# (hidden, ffn): one rectangular, and the two squares where a transposed weight-gradient GEMM (x^T dh
# taken for dh^T x) keeps its shape and only the values can tell: glu's gate_up_proj [E, 2F, H] at
# H = 2F, down_proj [E, H, F] and mlp's w1, w2 at H = F
SHAPES = [(8, 6), (8, 4), (8, 8)]


def _layer(top_k=2, hidden=8, ffn=6, **kw):
    torch.manual_seed(0)
    layer = shardmoe.MoE(hidden, ffn, 4, top_k, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


def _grads(out, aux, grad_out, inputs):
    return torch.autograd.grad((out * grad_out).sum() + aux, inputs)


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("hidden,ffn", SHAPES)
def test_backward_equals_reference_float64(kw, top_k, hidden, ffn):
    layer = _layer(top_k, hidden, ffn, **kw)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(13, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(13, hidden, generator=gen, dtype=torch.float64)
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
    # x (H) + h (k 2F) floats, probs E + logsumexp 1 + top_prob k + weight k floats, top_idx k + row_pair k int64;
    # per forward two [E] int64 counts and the balance losses' pending flag (one float)
    expected = 4 * (H + k * 2 * F) + 4 * (E + 1 + 2 * k) + 8 * 2 * k + (8 * 2 * E + 4) / S
    assert bytes_per_token == pytest.approx(expected)
    out.sum().backward()
    assert x.grad is not None


NOT_TWICE = r"MoEAutograd\.backward: the MoE backward is not twice differentiable"


@pytest.mark.parametrize("expert", ["glu", "mlp"])
def test_double_backward_raises_instead_of_a_wrong_second_derivative(expert):
    """A gradient penalty through the layer has no correct second derivative (the backward is not
    built from autograd ops), so it raises. The first-order gradients under create_graph=True are unchanged; a second
    backward through them, whether taken from x's gradient or a weight's, raises a clear error."""
    layer = _layer(expert=expert, bias=expert == "mlp")
    weight = layer.gate_up_proj if expert == "glu" else layer.w1
    x = torch.randn(13, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want = torch.autograd.grad(layer(x).square().sum(), [x, weight])
    for i in range(2):
        got = torch.autograd.grad(layer(x).square().sum(), [x, weight], create_graph=True)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        penalty = got[i].square().sum()
        assert penalty.requires_grad
        with pytest.raises(RuntimeError, match=NOT_TWICE):
            penalty.backward()


def _expert_parallel_double_backward() -> list[str]:
    import torch.distributed as dist

    from shardmoe.mesh import Mesh

    mesh, messages = Mesh(ep=dist.get_world_size()), []
    for expert in ("glu", "mlp"):
        torch.manual_seed(0)
        layer = shardmoe.MoE(8, 6, 4, 2, expert=expert, dtype=torch.float64, mesh=mesh)
        x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
        (grad_x,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        try:
            grad_x.square().sum().backward()
            messages.append("no error")
        except RuntimeError as err:
            messages.append(str(err))
    return messages


def test_expert_parallel_double_backward_raises_the_same_error():
    from shardmoe.testing import run_distributed

    for messages in run_distributed(_expert_parallel_double_backward, 2):
        assert len(messages) == 2
        for message in messages:
            assert re.match(NOT_TWICE, message), message  # one Function for every dispatcher


@pytest.mark.parametrize("options", [dict(bias=True), dict(shared_ffn_size=24, shared_gate=True),
                                     dict(ffn_size=8), dict(ffn_size=16), dict(expert="mlp", ffn_size=16)],
                         ids=["biased-glu", "gated-shared-expert", "glu-H=2F", "glu-H=F", "mlp-H=P"])
@pytest.mark.parametrize("dtype,bar", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_expert_options_in_low_precision_within_the_documented_bars(options, dtype, bar):
    """fp32 and bf16 biased glu (both biases non-zero), gated shared expert, and the square weight
    shapes of SHAPES (the grouped and side-by-side GEMMs of these dtypes) against the float64
    reference, bars of docs/moe.md."""
    from shardmoe.moe.reference import reference_forward_backward
    torch.manual_seed(0)
    options = {"ffn_size": 32, **options}
    layer = shardmoe.MoE(16, options.pop("ffn_size"), 4, 2, dtype=dtype, **options)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(20, 16, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(20, 16, dtype=dtype)
    (layer(x) * grad_out).sum().backward()
    params = {n: p.detach().double() for n, p in layer.named_parameters()}
    _, _, want = reference_forward_backward(x.detach().double(), params, layer.config, grad_out.double())
    for name, got in [("x", x.grad), *((n, p.grad) for n, p in layer.named_parameters())]:
        assert (got.double() - want[name]).abs().max() <= bar * want[name].abs().max(), name


def test_backward_of_only_the_loss_or_only_the_output():
    """Autograd hands the operator None for an unused output (no zero gradients are materialised,
    so no [N, 2F] of zeros for the made tensors): either output alone gives the gradients of the
    two with a zero for the other."""
    torch.manual_seed(0)
    # aux_loss_scale None: the loss is the operator's differentiable output, not riding on out
    layer = shardmoe.MoE(8, 6, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01, aux_loss_scale=None, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(5, 8, dtype=torch.float64)

    def grads(use_out, use_loss):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        torch.autograd.backward([out, layer.aux_loss], [grad_out * use_out, torch.tensor(1.0 * use_loss).double()])
        both = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        (out if use_out else layer.aux_loss).backward(grad_out if use_out else None)
        return both, [x.grad, *(p.grad for p in layer.parameters())]

    for use_out, use_loss in ((1, 0), (0, 1)):
        expected, got = grads(use_out, use_loss)
        for e, g in zip(expected, got):
            if g is None:  # no path from this output to the parameter (experts from the loss)
                assert e.abs().max() == 0
            else:
                torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
