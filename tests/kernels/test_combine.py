"""Combine-side kernels (float32) against the float64 torch path of shardmoe.moe.combine."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

from shardmoe.kernels import combine as kcomb  # noqa: E402
from shardmoe.moe import combine as comb  # noqa: E402
from shardmoe.moe.experts import TORCH_OPS  # noqa: E402
from shardmoe.moe.activations import activate, activate_backward  # noqa: E402

TOL = 1e-5
F32 = torch.float32


def expert_rows(routed, seed):
    """[N, H] stand-in for expert outputs (or input gradients) of the dispatched rows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(routed.row_pair.numel(), routed.x.shape[1], generator=gen, dtype=torch.float64).to(
        routed.x.device)


@pytest.mark.parametrize("top_k,drop_every", [(2, 7), (1, 0)], ids=["k2-drops", "k1"])
def test_token_combines(device, make_routed_batch, rel_err, top_k, drop_every):
    """combine (weighted) and grad_input_combine (unweighted) sum each token's kept rows;
    a token whose pairs were all dropped gets zeros."""
    routed = make_routed_batch(device, top_k=top_k, drop_every=drop_every)
    rows = expert_rows(routed, seed=7)
    S, k = routed.num_tokens, top_k
    expected = (comb.combine(TORCH_OPS, rows, routed.weight_rows, routed.row_pair, S, k),
                comb.grad_input_combine(TORCH_OPS, rows, routed.row_pair, S, k))
    got = (kcomb.combine(rows.to(F32), routed.weight_rows.to(F32), routed.row_pair, S, k),
           kcomb.grad_input_combine(rows.to(F32), routed.row_pair, S, k))
    for g, e in zip(got, expected):
        assert g.dtype == F32 and g.shape == (S, routed.x.shape[1])
        assert rel_err(g, e) < TOL


def test_grad_gate_combine(routed, rel_err):
    grad_rows = routed.grad_out[routed.row_token]
    out_rows = expert_rows(routed, seed=8)
    g32, o32 = grad_rows.to(F32), out_rows.to(F32)
    dots = kcomb.grad_gate_combine(g32, o32)
    assert dots.dtype == F32 and rel_err(dots, comb.grad_gate_combine(TORCH_OPS, grad_rows, out_rows)) < TOL


@pytest.mark.parametrize("output_activation", ["identity", "gelu_tanh"])
def test_grad_combine_and_gate_dots(routed, rel_err, output_activation):
    """Stages 1 + 2 and act_out' in one pass, g gathered from token order, act_out and its derivative
    applied to the saved z2."""
    z2 = expert_rows(routed, seed=9)
    grad_rows = routed.grad_out[routed.row_token]
    expected = (activate_backward(output_activation, comb.grad_combine(TORCH_OPS, grad_rows, routed.weight_rows), z2),
                comb.grad_gate_combine(TORCH_OPS, grad_rows, activate(output_activation, z2)))
    r32 = routed.cast(F32)
    got = kcomb.grad_combine_and_gate_dots(r32.grad_out, z2.to(F32), r32.weight_rows,
                                           output_activation=output_activation, row_index=r32.row_token)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == F32 and g.shape == e.shape
        assert rel_err(g, e) < TOL
