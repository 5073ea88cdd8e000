"""Backward kernels (float32): fGETGrad input-gradient GEMMs and weight/bias-gradient GEMMs,
against the float64 torch path of shardmoe.moe.experts."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

from shardmoe.expert_kinds import GLU, MLP  # noqa: E402
from shardmoe.kernels import experts as kex  # noqa: E402
from shardmoe.moe import combine as comb  # noqa: E402
from shardmoe.moe import experts as ex  # noqa: E402
from shardmoe.moe.activations import ClampedSwiGLU, activate  # noqa: E402

TOL = 1e-5
F32 = torch.float32
ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "silu", "identity"]
CLAMPED = ClampedSwiGLU(limit=0.5, alpha=1.702)  # both clamps act on these rows (h about unit variance)


def groups_of(routed):
    return ex.Groups.from_counts(routed.counts)


def random_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)


def assert_all_close(got, expected, rel_err):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            assert g.dtype == F32 and g.shape == e.shape
            assert rel_err(g, e) < TOL


def test_grouped_gemms(routed, expert_params, rel_err):
    """The plain grouped GEMMs: rows W_e, sum grad^T in per expert (zeros for empty experts), bias sums."""
    groups = groups_of(routed)
    down = expert_params("glu", False, routed.x.device)["down_proj"]  # [E, H, F]
    rows = routed.x[routed.row_token]  # [N, H]
    act = random_like(rows[:, : down.shape[2]], seed=3)  # [N, F]
    expected = (ex.grouped_linear_t(rows, down, groups), ex.grouped_weight_grad(rows, act, groups),
                ex.grouped_bias_grad(rows, groups))
    r32, d32, a32 = rows.to(F32), down.to(F32), act.to(F32)
    got = (kex.grouped_linear_t(r32, d32, groups), kex.grouped_weight_grad(r32, a32, groups),
           kex.grouped_bias_grad(r32, groups))
    assert_all_close(got, expected, rel_err)
    empty = [e for e, size in enumerate(groups.sizes) if size == 0]
    assert empty and got[1][empty].abs().max() == 0 and got[2][empty].abs().max() == 0


def _glu_saved(routed, params, activation):
    """(xs, h, a, act_gate) of the float64 forward."""
    groups = groups_of(routed)
    xs = routed.x[routed.row_token]
    _, (h,) = ex.expert_forward(GLU, activation, "identity", xs, params, groups)
    a, act_gate = ex.glu_activation(h, activation)
    return xs, h, a, act_gate


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_grad_post_gemm_glu(routed, expert_params, rel_err, bias):
    """Stage 3 (dA, dWdown, g Wdown, dbdown), on rows and gathered; stages 2 + 3 fused, whose gate
    dots gain g . bdown_e with the down bias (y = a Wdown_e^T + bdown_e)."""
    groups = groups_of(routed)
    params = expert_params("glu", bias, routed.x.device)
    _, _, a, _ = _glu_saved(routed, params, "silu")
    grad_rows = routed.grad_out[routed.row_token]
    expected = ex.grad_post_gemm_glu(grad_rows, routed.weight_rows, a, params["down_proj"], groups, bias)
    assert (expected[3] is not None) == bias
    r32 = routed.cast(F32)
    args = (r32.weight_rows, a.to(F32), params["down_proj"].to(F32), groups, bias)
    assert_all_close(kex.grad_post_gemm_glu(r32.grad_out[r32.row_token], *args), expected, rel_err)
    assert_all_close(kex.grad_post_gemm_glu(r32.grad_out, *args, row_index=r32.row_token), expected, rel_err)

    grad_a, grad_down, g_down, grad_down_bias = expected
    dots = comb.grad_gate_combine(g_down, a)
    down_bias = params["down_proj_bias"]
    if bias:
        dots = dots + comb.grad_gate_combine(grad_rows, down_bias[groups.row_expert()])
        assert rel_err(dots, comb.grad_gate_combine(g_down, a)) > 1e-2  # the bias term is no round-off
    fused = kex.grad_gate_post_gemm_glu(r32.grad_out, r32.weight_rows, a.to(F32), params["down_proj"].to(F32),
                                        groups, None if down_bias is None else down_bias.to(F32), bias,
                                        row_index=r32.row_token)
    assert_all_close(fused, (grad_a, grad_down, dots, grad_down_bias), rel_err)


@pytest.mark.parametrize("activation,bias", [(a, False) for a in ACTIVATIONS] + [("silu", True), (CLAMPED, False),
                                                                                  (CLAMPED, True)],
                         ids=[*ACTIVATIONS, "silu-bias", "clamped", "clamped-bias"])
def test_grad_pre_gemm_glu(routed, expert_params, rel_err, activation, bias):
    """Stage 4 (dx, dWgu, dbgu) with dh formed in registers: every activation, the clamped SwiGLU's
    derivative (zero beyond its clamps) and the gate/up bias gradient."""
    groups = groups_of(routed)
    params = expert_params("glu", bias, routed.x.device)
    xs, h, a, act_gate = _glu_saved(routed, params, activation)
    grad_a = random_like(a, seed=4)
    expected = ex.grad_pre_gemm_glu(grad_a, h, act_gate, xs, params["gate_up_proj"], groups, activation, bias)
    assert (expected[2] is not None) == bias
    got = kex.grad_pre_gemm_glu(grad_a.to(F32), h.to(F32), act_gate.to(F32), routed.x.to(F32),
                                params["gate_up_proj"].to(F32), groups, activation, bias, row_index=routed.row_token)
    assert_all_close(got, expected, rel_err)


@pytest.mark.parametrize("output_activation,bias", [(a, i % 2 == 0) for i, a in enumerate(ACTIVATIONS)])
def test_grad_post_gemm_mlp(routed, expert_params, cast, rel_err, output_activation, bias):
    groups = groups_of(routed)
    params = expert_params("mlp", bias, routed.x.device)
    _, (z1, z2) = ex.expert_forward(MLP, "gelu", output_activation, routed.x[routed.row_token], params, groups)
    a1 = activate("gelu", z1)
    grad_expert = random_like(z2, seed=5)
    expected = ex.grad_post_gemm_mlp(grad_expert, z2, a1, params["w2"], bias, groups, output_activation)
    got = kex.grad_post_gemm_mlp(*cast((grad_expert, z2, a1, params["w2"]), F32), bias, groups, output_activation)
    assert_all_close(got, expected, rel_err)


@pytest.mark.parametrize("activation,bias", [(a, i % 2 == 1) for i, a in enumerate(ACTIVATIONS)])
def test_grad_pre_gemm_mlp(routed, expert_params, cast, rel_err, activation, bias):
    groups = groups_of(routed)
    params = expert_params("mlp", bias, routed.x.device)
    xs = routed.x[routed.row_token]
    _, (z1, _) = ex.expert_forward(MLP, activation, "identity", xs, params, groups)
    grad_a1 = random_like(z1, seed=6)
    expected = ex.grad_pre_gemm_mlp(grad_a1, z1, xs, params["w1"], bias, groups, activation)
    got = kex.grad_pre_gemm_mlp(*cast((grad_a1, z1, routed.x, params["w1"]), F32), bias, groups, activation,
                                row_index=routed.row_token)
    assert_all_close(got, expected, rel_err)
