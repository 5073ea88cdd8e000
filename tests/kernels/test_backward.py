"""Backward kernels (float32): the glu backward (down_grad's GEMM and epilogue, the varlen-K weight
gradients, dx), the fGETGrad input-gradient GEMMs and the weight/bias-gradient GEMMs, against the
float64 torch path of shardmoe.moe.experts."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

from shardmoe.expert_kinds import GLU, MLP  # noqa: E402
from shardmoe.kernels import stages as kex  # noqa: E402
from shardmoe.kernels.down_grad import down_grad  # noqa: E402
from shardmoe.kernels.grad_gemm import grad_gemm  # noqa: E402
from shardmoe.kernels.weight_grad import weight_and_bias_grad  # noqa: E402
from shardmoe.moe import combine as comb  # noqa: E402
from shardmoe.moe.experts import TORCH_OPS  # noqa: E402
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
    expected = (TORCH_OPS.linear_t(rows, down, groups), TORCH_OPS.weight_grad(rows, act, groups),
                TORCH_OPS.bias_grad(rows, groups))
    r32, d32, a32 = rows.to(F32), down.to(F32), act.to(F32)
    got = (grad_gemm(r32, d32, groups), *weight_and_bias_grad(r32, a32, groups, with_bias=True))
    assert_all_close(got, expected, rel_err)
    empty = [e for e, size in enumerate(groups.sizes) if size == 0]
    assert empty and got[1][empty].abs().max() == 0 and got[2][empty].abs().max() == 0


def _glu_saved(routed, params, activation):
    """(xs, h) of the float64 forward."""
    groups = groups_of(routed)
    xs = routed.x[routed.row_token]
    _, (h,) = TORCH_OPS.expert_forward(GLU, activation, "identity", xs, params, groups)
    return xs, h


@pytest.mark.parametrize("activation,bias", [(a, False) for a in ACTIVATIONS] + [("silu", True), (CLAMPED, False),
                                                                                  (CLAMPED, True)],
                         ids=[*ACTIVATIONS, "silu-bias", "clamped", "clamped-bias"])
def test_glu_expert_backward(routed, expert_params, rel_err, activation, bias):
    """Stages 2-4 of "glu" (dx rows, gate dots, every gradient) against the torch path's stages in
    float64: every activation, the clamped SwiGLU's derivative (zero beyond its clamps), both
    biases, whose g . bdown_e term joins the gate dots; g and x read in token order."""
    groups = groups_of(routed)
    params = expert_params("glu", bias, routed.x.device)
    xs, h = _glu_saved(routed, params, activation)
    grad_rows = routed.grad_out[routed.row_token]
    dx, dots, grads = TORCH_OPS.expert_backward(GLU, activation, "identity", grad_rows, routed.weight_rows, xs, (h,),
                                         params, groups)
    if bias:  # the bias term is no round-off
        without = TORCH_OPS.expert_backward(GLU, activation, "identity", grad_rows, routed.weight_rows, xs, (h,),
                                     {**params, "down_proj_bias": None}, groups)[1]
        assert rel_err(without, dots) > 1e-2
    r32 = routed.cast(F32)
    params32 = {k: None if v is None else v.to(F32) for k, v in params.items()}
    got_dx, got_dots, got = kex.glu_expert_backward(r32.grad_out, r32.weight_rows, r32.x, h.to(F32), params32, groups,
                                             activation, row_index=r32.row_token)
    assert_all_close((got_dx, got_dots), (dx, dots), rel_err)
    assert set(got) == set(grads)
    assert_all_close([got[k] for k in grads], [grads[k] for k in grads], rel_err)
    rows = kex.glu_expert_backward(r32.grad_out[r32.row_token], r32.weight_rows, r32.x[r32.row_token], h.to(F32), params32,
                            groups, activation)
    assert_all_close(rows[:2], (dx, dots), rel_err)


def test_down_grad_epilogue(routed, expert_params, rel_err):
    """down_grad's three outputs on their own: dh = dSwiGLU(w g Wdown_e, h), a' = w a, the dots."""
    groups = groups_of(routed)
    params = expert_params("glu", False, routed.x.device)
    _, h = _glu_saved(routed, params, "silu")
    grad_rows = routed.grad_out[routed.row_token]
    a, act_gate = ex.glu_activation(TORCH_OPS, h, "silu")
    g_down = TORCH_OPS.linear_t(grad_rows, params["down_proj"], groups)
    expected = (TORCH_OPS.glu_backward(g_down * routed.weight_rows[:, None], h, act_gate, "silu"), a * routed.weight_rows[:, None],
                comb.grad_gate_combine(TORCH_OPS, g_down, a))
    r32 = routed.cast(F32)
    got = down_grad(r32.grad_out, r32.weight_rows, h.to(F32), params["down_proj"].to(F32), groups, "silu",
                    grad_index=r32.row_token)
    assert_all_close(got, expected, rel_err)


@pytest.mark.parametrize("activation,output_activation,bias",
                         [(a, b, i % 2 == 0) for i, (a, b) in enumerate(zip(ACTIVATIONS, ACTIVATIONS[::-1]))])
def test_mlp_expert_backward(routed, expert_params, rel_err, activation, output_activation, bias):
    """Stages 1-4 of "mlp" (dx rows, gate dots, every gradient) against the torch path's stages in
    float64: every activation in both places, act_out' formed in the combine pass and act' in the
    da1 GEMM's epilogue; g and x read in token order."""
    groups = groups_of(routed)
    params = expert_params("mlp", bias, routed.x.device)
    xs = routed.x[routed.row_token]
    _, (z1, z2) = TORCH_OPS.expert_forward(MLP, activation, output_activation, xs, params, groups)
    grad_rows = routed.grad_out[routed.row_token]
    dx, dots, grads = TORCH_OPS.expert_backward(MLP, activation, output_activation, grad_rows, routed.weight_rows, xs,
                                         (z1, z2), params, groups)
    r32 = routed.cast(F32)
    params32 = {k: None if v is None else v.to(F32) for k, v in params.items()}
    z1_32 = z1.to(F32)
    got_dx, got_dots, got = kex.mlp_expert_backward(r32.grad_out, r32.weight_rows, r32.x, z1_32, z2.to(F32),
                                             activate(activation, z1_32), params32, groups, activation,
                                             output_activation, row_index=r32.row_token)
    assert_all_close((got_dx, got_dots), (dx, dots), rel_err)
    assert set(got) == set(grads)
    assert_all_close([got[k] for k in grads], [grads[k] for k in grads], rel_err)
