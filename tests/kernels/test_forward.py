"""Forward kernels (float32) against the float64 torch path of shardmoe.moe.experts / combine."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

from shardmoe.expert_kinds import GLU, expert_kind  # noqa: E402
from shardmoe.kernels import combine as kernel_combine  # noqa: E402
from shardmoe.kernels import stages as kex  # noqa: E402
from shardmoe.kernels.forward_gemm import forward_gemm  # noqa: E402
from shardmoe.moe import combine as comb  # noqa: E402
from shardmoe.moe.experts import TORCH_OPS  # noqa: E402
from shardmoe.moe import experts as ex  # noqa: E402
from shardmoe.moe.activations import ClampedSwiGLU  # noqa: E402

TOL = 1e-5
F32, F64 = torch.float32, torch.float64
# Every activation appears once as act and once as act_out, with and without biases.
MLP_CASES = [("relu", "identity", True), ("gelu", "silu", False), ("gelu_tanh", "gelu_tanh", True),
             ("silu", "relu", True), ("identity", "gelu", False)]
ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "silu", "identity"]
# GPT-OSS's clamped SwiGLU with a limit that h (about unit variance here) crosses on both halves
CLAMPED = ClampedSwiGLU(limit=0.5, alpha=1.702)
GLU_KINDS = [("silu", True), (CLAMPED, False), (CLAMPED, True)]
GLU_KIND_IDS = ["silu-bias", "clamped", "clamped-bias"]


def forward_combine(kind, activation, output_activation, x, row_token, weight_rows, row_pair, params, groups, top_k):
    """The local dispatcher's forward on the kernels: expert_forward gathering x through row_token,
    then each token sums its rows w_r y_r (kernels/combine.py): (out [S, H] float32, saved)."""
    y, saved = kex.expert_forward(kind, activation, output_activation, x, params, groups, row_index=row_token)
    return kernel_combine.combine(y, weight_rows, row_pair, x.shape[0], top_k), saved


def groups_of(routed):
    return ex.Groups.from_counts(routed.counts)


@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
def test_forward_gemm(routed, expert_params, rel_err, gather):
    groups = groups_of(routed)
    weight = expert_params("glu", False, routed.x.device)["gate_up_proj"]
    expected = TORCH_OPS.linear(routed.x[routed.row_token], weight, groups)
    x32, w32 = routed.x.to(F32), weight.to(F32)
    got = (forward_gemm(x32, w32, groups, a_index=routed.row_token) if gather
           else forward_gemm(x32[routed.row_token], w32, groups))
    assert got.dtype == F32 and got.shape == expected.shape
    assert rel_err(got, expected) < TOL


def _check_expert_forward(routed, params, cast, rel_err, expert, act, act_out):
    groups, kind = groups_of(routed), expert_kind(expert)
    y_ref, saved_ref = TORCH_OPS.expert_forward(kind, act, act_out, routed.x[routed.row_token], params, groups)
    y, saved = kex.expert_forward(kind, act, act_out, routed.x.to(F32), cast(params, F32), groups,
                                  row_index=routed.row_token)
    assert y.dtype == F32 and len(saved) == len(saved_ref)
    assert rel_err(y, y_ref) < TOL
    for got, expected in zip(saved, saved_ref):
        assert rel_err(got, expected) < TOL


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_expert_forward_glu(routed, expert_params, cast, rel_err, activation):
    params = expert_params("glu", False, routed.x.device)
    _check_expert_forward(routed, params, cast, rel_err, "glu", activation, "identity")


@pytest.mark.parametrize("activation,bias", GLU_KINDS, ids=GLU_KIND_IDS)
def test_expert_forward_glu_kinds(routed, expert_params, cast, rel_err, activation, bias):
    """The glu biases in both GEMMs' epilogues and the clamped SwiGLU in the first one's."""
    params = expert_params("glu", bias, routed.x.device)
    if isinstance(activation, ClampedSwiGLU):  # both clamps act on these rows
        _, (h,) = TORCH_OPS.expert_forward(GLU, activation, "identity", routed.x[routed.row_token], params,
                                    groups_of(routed))
        gate, up = h.chunk(2, dim=1)
        assert (gate > activation.limit).float().mean() > 0.1 and (up.abs() > activation.limit).float().mean() > 0.1
    _check_expert_forward(routed, params, cast, rel_err, "glu", activation, "identity")


@pytest.mark.parametrize("activation,output_activation,bias", MLP_CASES)
def test_expert_forward_mlp(routed, expert_params, cast, rel_err, activation, output_activation, bias):
    params = expert_params("mlp", bias, routed.x.device)
    _check_expert_forward(routed, params, cast, rel_err, "mlp", activation, output_activation)


def test_expert_forward_without_gather_matches_gathered(routed, expert_params, cast):
    """The same-signature call (pre-gathered rows) and the in-kernel gather agree exactly."""
    groups = groups_of(routed)
    params = cast(expert_params("glu", False, routed.x.device), F32)
    x = routed.x.to(F32)
    y_rows, _ = kex.expert_forward(GLU, "silu", "identity", x[routed.row_token], params, groups)
    y_gathered, _ = kex.expert_forward(GLU, "silu", "identity", x, params, groups, row_index=routed.row_token)
    torch.testing.assert_close(y_rows, y_gathered, rtol=0, atol=0)


@pytest.mark.parametrize("expert,activation,output_activation,bias,top_k,drop_every",
                         [("glu", "silu", "identity", False, 2, 7), ("mlp", "gelu", "silu", True, 2, 7),
                          ("mlp", "relu", "identity", True, 1, 0), ("glu", "gelu_tanh", "identity", False, 1, 5),
                          ("glu", CLAMPED, "identity", True, 2, 7)],
                         ids=["glu-k2-drops", "mlp-k2-drops", "mlp-k1", "glu-k1-drops", "glu-clamped-bias-k2-drops"])
def test_expert_forward_combine(device, make_routed_batch, expert_params, cast, rel_err,
                                expert, activation, output_activation, bias, top_k, drop_every):
    routed = make_routed_batch(device, top_k=top_k, drop_every=drop_every)
    groups, kind = groups_of(routed), expert_kind(expert)
    params = expert_params(expert, bias, device)
    y_ref, saved_ref = TORCH_OPS.expert_forward(kind, activation, output_activation, routed.x[routed.row_token],
                                         params, groups)
    out_ref = comb.combine(TORCH_OPS, y_ref, routed.weight_rows, routed.row_pair, routed.num_tokens, top_k)
    r32 = routed.cast(F32)
    out, saved = forward_combine(kind, activation, output_activation, r32.x, r32.row_token,
                                 r32.weight_rows, r32.row_pair, cast(params, F32), groups, top_k)
    assert out.dtype == F32 and out.shape == (routed.num_tokens, routed.x.shape[1])
    assert rel_err(out, out_ref) < TOL
    for got, expected in zip(saved, saved_ref, strict=True):
        assert rel_err(got, expected) < TOL


def test_no_kept_rows(device, expert_params, cast):
    """Every pair dropped: the layer output is zero and the first GEMM saves an empty h."""
    groups = ex.Groups.from_counts(torch.zeros(6, dtype=torch.int64))
    none = torch.zeros(0, dtype=torch.int64, device=device)
    x = torch.randn(5, 40, device=device)
    params = cast(expert_params("glu", False, device), F32)
    out, (h,) = forward_combine(GLU, "silu", "identity", x, none, none.to(F32), none, params, groups, 2)
    assert torch.equal(out, torch.zeros(5, 40, device=device))
    assert h.shape == (0, 2 * params["down_proj"].shape[2])
