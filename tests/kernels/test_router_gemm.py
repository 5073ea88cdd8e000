"""The router's GEMM kernel (kernels/router_gemm.py): its three products against float64 within
float32's round-off bound, the split reduction, the layer's router gradients through it against the
float64 reference, the dispatch in moe/routing.py, and the wrapper's refusals.

Bound, per element of C = A B (K the reduction length, eps32 = 2^-23 float32's machine epsilon):
  |C - C64| <= (K + 6) eps32 (|A| |B|)
K eps32 is twice the classic float32 accumulation bound (K u, u = eps32 / 2), the margin for the
tensor cores' accumulation and the split reduction's partial sums; 6 eps32 = 3 * 2^-22 covers
tf32x3's product on a GPU: with a = hi + lo rounded to TF32 (2^-11 relative each), lo lo is dropped
(2^-22 of the product) and lo's own rounding costs 2^-22 in each operand."""
import os

import pytest
import torch

from shardmoe import kernels, settings

if not kernels.triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

import shardmoe  # noqa: E402
from shardmoe.kernels import router_gemm  # noqa: E402
from shardmoe.kernels.router_gemm import router_mm  # noqa: E402
from shardmoe.moe import routing  # noqa: E402
from shardmoe.moe.reference import reference_forward_backward  # noqa: E402

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
EPS32 = 2.0 ** -23
# CPU tensors through the force_kernels setting reach the kernels only in the interpreter (tests/kernels/conftest.py)
interpreter_only = pytest.mark.skipif(os.environ.get("SHARDMOE_TEST_COMPILED", "0") == "1",
                                      reason="compiled mode: CPU tensors through the force_kernels setting run only in the "
                                             "interpreter")


def bound_ratio(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """max over C of |C - C64| / ((K + 6) eps32 (|A| |B|)): at most 1 within the bound."""
    a64, b64 = a.double().cpu(), b.double().cpu()
    err = (got.double().cpu() - a64 @ b64).abs()
    scale = (a.shape[1] + 6) * EPS32 * (a64.abs() @ b64.abs())
    return (err / scale.clamp_min(torch.finfo(F64).tiny)).max().item()


def router_operands(num_tokens, hidden, num_experts, x_dtype, weight_dtype, device, seed=0):
    """(x [S, H], gate_weight [H, E], dlogits [S, E] float32), values exactly representable in their dtypes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(x_dtype).to(device)
    weight = (torch.randn(hidden, num_experts, generator=gen) / hidden ** 0.5).to(weight_dtype).to(device)
    dlogits = (torch.randn(num_tokens, num_experts, generator=gen) * 1e-3).to(device)
    return x, weight, dlogits


@pytest.mark.parametrize("num_experts,num_tokens", [(8, 37), (64, 50), (128, 23)])
@pytest.mark.parametrize("x_dtype,weight_dtype", [(F32, F32), (BF16, BF16), (BF16, F32)],
                         ids=["f32", "bf16", "bf16-x-f32-weight"])
def test_three_router_products_within_float32_round_off(device, num_experts, num_tokens, x_dtype, weight_dtype):
    """x Wg, dlogits Wg^T and x^T dlogits, the transposed operands as views, float32 out [M, N]."""
    x, weight, dlogits = router_operands(num_tokens, 72, num_experts, x_dtype, weight_dtype, device)
    for a, b in ((x, weight), (dlogits, weight.t()), (x.t(), dlogits)):
        got = router_mm(a, b)
        assert got.dtype == F32 and got.shape == (a.shape[0], b.shape[1]) and got.is_contiguous()
        assert bound_ratio(got, a, b) <= 1.0


def test_split_reduction_sums_every_chunk(device, monkeypatch):
    """A reduction longer than the output's rows and than a chunk (dWg over many tokens) is split into
    chunks, the last one partial, summed afterwards; the result is that of one reduction."""
    monkeypatch.setattr(router_gemm, "SPLIT_K_CHUNK", 32)
    x, _, dlogits = router_operands(100, 40, 8, BF16, F32, device, seed=1)
    assert router_gemm.k_chunk(40, 100) == 32  # 4 chunks: 32, 32, 32, 4
    got = router_mm(x.t(), dlogits)
    assert bound_ratio(got, x.t(), dlogits) <= 1.0
    monkeypatch.setattr(router_gemm, "SPLIT_K_CHUNK", 2048)
    assert router_gemm.k_chunk(40, 100) == 100
    assert bound_ratio(router_mm(x.t(), dlogits), x.t(), dlogits) <= 1.0


def test_empty_products(device):
    a = torch.zeros(0, 5, device=device)
    assert router_mm(a, torch.ones(5, 8, device=device)).shape == (0, 8)
    zero_k = router_mm(torch.ones(3, 0, device=device), torch.ones(0, 8, device=device))
    assert zero_k.shape == (3, 8) and not zero_k.any()


@pytest.mark.parametrize("a,b,message", [
    (torch.ones(4), torch.ones(4, 2), "a: expected a 2-D tensor [M, K], got shape (4,)"),
    (torch.ones(3, 4), torch.ones(4, 2, dtype=torch.float16),
     "b: expected dtype float32 or bfloat16, got torch.float16"),
    (torch.ones(3, 4, dtype=F64), torch.ones(4, 2), "a: expected dtype float32 or bfloat16, got torch.float64"),
    (torch.ones(3, 4), torch.ones(5, 2), "b: expected 4 rows (a's columns, K), got shape (5, 2)"),
    (torch.ones(3, 4), torch.ones(4, 2, device="meta"), "b: expected a tensor on a's device cpu, got meta"),
])
def test_bad_input_is_refused_by_name(a, b, message):
    with pytest.raises(ValueError) as err:
        router_mm(a, b)
    assert str(err.value) == message
    with pytest.raises(TypeError, match="b: expected a torch.Tensor, got list"):
        router_mm(torch.ones(2, 2), [[1.0]])


@pytest.fixture
def router_calls(monkeypatch):
    """The (a dtype, a strides, b dtype, b strides) of every router_mm call."""
    calls = []

    def spy(a, b):
        calls.append((a.dtype, a.stride(), b.dtype, b.stride()))
        return router_mm(a, b)
    monkeypatch.setattr(router_gemm, "router_mm", spy)
    return calls


@interpreter_only
def test_layer_router_gradients_through_the_kernel(router_calls):
    """A float32 layer under the force_kernels setting: the router's three GEMMs run on the kernel (x and
    gate_weight read in place: x^T and Wg^T as strided views), and the output, x's and every
    parameter's gradient, router bias and aux / z losses included, are within 1e-5 of the float64
    reference."""
    H, F, E, K = 40, 24, 8, 2
    options = dict(expert="glu", activation="silu", router_bias=True, aux_loss_coef=0.1, z_loss_coef=0.01)
    torch.manual_seed(0)
    layer64 = shardmoe.MoE(H, F, E, K, dtype=F64, **options)
    with torch.no_grad():
        for p in layer64.parameters():
            p.normal_(0, 0.3)
    layer = shardmoe.MoE(H, F, E, K, **options)
    layer.load_state_dict({k: v.float() for k, v in layer64.state_dict().items()})
    gen = torch.Generator().manual_seed(1)
    x, grad_out = torch.randn(29, H, generator=gen, dtype=F64), torch.randn(29, H, generator=gen, dtype=F64)
    x32 = x.float().requires_grad_()
    with settings.override(force_kernels=True):
        out = layer(x32)
        out.backward(grad_out.float())
    assert router_calls == [(F32, (H, 1), F32, (E, 1)),  # x Wg
                            (F32, (E, 1), F32, (1, E)),  # dlogits Wg^T
                            (F32, (1, H), F32, (E, 1))]  # x^T dlogits
    params64 = {k: v.detach() for k, v in layer64.named_parameters()}
    ref_out, ref_aux, ref_grads = reference_forward_backward(x, params64, layer64.config, grad_out)

    def rel(actual, expected):
        return (actual.double() - expected).abs().max().item() / expected.abs().max().item()

    assert rel(out, ref_out) < 1e-5 and rel(layer.aux_loss, ref_aux) < 1e-5
    assert rel(x32.grad, ref_grads["x"]) < 1e-5
    for name in ("gate_weight", "gate_bias"):
        grad = dict(layer.named_parameters())[name].grad
        assert grad.dtype == F32 and rel(grad, ref_grads[name]) < 1e-5, name


@interpreter_only
def test_routing_takes_the_kernel_only_where_router_path_says(router_calls):
    """Outside the force_kernels setting CPU tensors keep routing.py's torch products; under autograd (the
    kernel has no backward), without a dtype (the transformers seam) and for float64 the kernel is not
    taken even when forced; a bf16 x goes to the kernel as it is (no float32 copy), float32 out."""
    x, weight, dlogits = router_operands(11, 24, 8, BF16, BF16, "cpu")
    assert routing.gate_logits(x, weight, F32).dtype == F32 and router_calls == []
    with settings.override(force_kernels=True):
        grad_weight = weight.float().requires_grad_()
        routing.gate_logits(x.float(), grad_weight, F32)
        routing.gate_logits(x.float(), weight.float())  # no dtype: the transformers seam's torch product
        routing.gate_logits(x.double(), weight.double(), F64)
        assert router_calls == []
        logits = routing.gate_logits(x, weight, F32)
        routing.gate_weight_grad(x, dlogits)
        routing.gate_input_grad(dlogits, weight)
    assert [c[0] for c in router_calls] == [BF16, BF16, F32]
    assert bound_ratio(logits, x, weight) <= 1.0
