"""A whole MoE layer, forward and backward, assembled from the kernels in float32, against
the layer (the MoE operators of shardmoe/moe/function.py) in float64.

The expert side is TritonOps' stages, which the MoE operators run on the kernel path: rows are
gathered inside the kernels (no x[row_token] or grad_out[row_token] copies), each token gathers
and sums its rows, stages 1 + 2 (mlp) run as one kernel and glu's stages 2-4 as one GEMM with its
epilogue and three plain GEMMs. Routing and stage 6 run in routing.py: on torch for the interpreter's
CPU tensors, their three GEMMs on the router kernel for CUDA tensors (compiled mode).
tests/kernels/test_layer_path.py runs the same code through the layer.
"""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

from shardmoe.kernels import combine as kcomb  # noqa: E402
from shardmoe.moe.config import MoEConfig  # noqa: E402
from shardmoe.moe.experts import Groups  # noqa: E402
from shardmoe.moe.dispatch import LOCAL  # noqa: E402
from shardmoe.moe import function  # noqa: E402
from shardmoe.moe.function import MoEContext  # noqa: E402
from shardmoe.moe.routing import GateRouter, balance_loss, grad_gate_gemm, route  # noqa: E402
from shardmoe.moe.triton_ops import TRITON_OPS  # noqa: E402
from shardmoe import settings  # noqa: E402

TOL = 1e-5
F32, F64 = torch.float32, torch.float64


def kernel_moe(x, gate_weight, params, config: MoEConfig, grad_out, grad_loss):
    """(out [S, H], loss, {"x", "gate_weight", *expert params: gradient}, routing), the expert side
    by TritonOps' stages as the local dispatcher calls them (through row_index), called directly."""
    num_tokens, k = x.shape[0], config.top_k
    routing = route(x, gate_weight, config)
    groups = Groups.from_counts(routing.kept_per_expert, num_rows=routing.row_pair.shape[0])
    row_token, weight_rows = routing.rows(k)
    activation = config.expert_activation  # the name, or a ClampedSwiGLU
    y, saved = TRITON_OPS.expert_forward(config.kind, activation, config.output_activation, x, params, groups,
                                         row_index=row_token)
    out = TRITON_OPS.combine(y, weight_rows, routing.row_pair, num_tokens, k)
    loss = balance_loss(routing, config)
    grad_xs, grad_weight_rows, expert_grads = TRITON_OPS.expert_backward(
        config.kind, activation, config.output_activation, grad_out, weight_rows, x, saved, params, groups,
        row_index=row_token)
    grads = {n: expert_grads[n] for n in config.expert_param_names}  # the glu's bias keys only with bias
    grad_x = kcomb.grad_input_combine(grad_xs, routing.row_pair, num_tokens, k)
    grad_weight = grad_weight_rows.new_zeros(num_tokens * k)
    grad_weight[routing.row_pair] = grad_weight_rows
    grad_x_gate, grads["gate_weight"], _ = grad_gate_gemm(x, gate_weight, routing,
                                                          grad_weight.view(num_tokens, k), grad_loss, config)
    grads["x"] = grad_x + grad_x_gate
    return out, loss, grads, routing


class _Owner:
    """An owner of the MoE operators (moe/function.py) that runs every forward with one MoEContext."""

    def __init__(self, context: MoEContext):
        self.context = context

    def moe_context(self, x, inputs) -> MoEContext:
        return self.context


def fused_operator(x, gate_weight, params, config: MoEConfig, grad_out, grad_loss):
    """(out, loss, grads, routing) of the MoE operator in the inputs' dtype, gradients by its explicit
    backward (the torch path for float64, and for CPU tensors of any dtype)."""
    names = config.expert_param_names
    leaves = {"x": x, "gate_weight": gate_weight, **{n: params[n] for n in names}}
    leaves = {n: None if t is None else t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    owner = _Owner(MoEContext(config, GateRouter(config), LOCAL))
    present, absent = function.operator_inputs((leaves["gate_weight"], None, None, None, *(leaves[n] for n in names)))
    out, loss, _ = torch.ops.shardmoe.moe_forward(function.register(owner), leaves["x"], present, absent)
    torch.autograd.backward([out, loss], [grad_out, grad_loss])
    grads = {n: None if t is None else t.grad for n, t in leaves.items()}
    return out.detach(), loss.detach(), grads, route(x, gate_weight, config)


CONFIGS = [
    dict(expert="glu", activation="silu"),
    dict(expert="mlp", activation="gelu", output_activation="gelu_tanh", bias=True),
    # GPT-OSS's expert: glu biases, the clamped SwiGLU with a limit that clamps both halves here
    dict(expert="glu", activation="clamped_swiglu", swiglu_limit=0.5, bias=True),
]
CONFIG_IDS = ["glu-silu", "mlp-gelu-bias", "glu-clamped-bias"]


@pytest.mark.parametrize("options", CONFIGS, ids=CONFIG_IDS)
def test_layer_forward_backward(device, routed, expert_params, cast, rel_err, options):
    config = MoEConfig(hidden_size=routed.x.shape[1], ffn_size=expert_params("glu", False, "cpu")["down_proj"].shape[2],
                       num_experts=6, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01, z_loss_coef=0.001, **options)
    gen = torch.Generator().manual_seed(11)
    gate_weight = torch.randn(config.hidden_size, config.num_experts, generator=gen, dtype=F64).to(device)
    # A constant feature with a large negative gate weight keeps expert 4 out of every top-k.
    x = routed.x.clone()
    x[:, 0] = 3.0
    gate_weight[0, 4] = -10.0
    params = expert_params(config.expert, config.bias, device)
    grad_loss = torch.tensor(0.7, dtype=F64, device=device)
    expected = fused_operator(x, gate_weight, params, config, routed.grad_out, grad_loss)
    got = kernel_moe(*cast((x, gate_weight, params), F32), config, routed.grad_out.to(F32), grad_loss.to(F32))

    # Same routing decisions in both precisions: an empty expert and capacity drops included.
    assert torch.equal(got[3].row_pair, expected[3].row_pair)
    assert expected[3].kept_per_expert[4] == 0
    assert expected[3].kept_per_expert.sum() < routed.num_tokens * config.top_k
    assert rel_err(got[0], expected[0]) < TOL
    assert rel_err(got[1], expected[1]) < TOL
    assert set(got[2]) == set(expected[2])
    for name, grad in expected[2].items():
        if grad is None:
            assert got[2][name] is None
        else:
            assert got[2][name].dtype == F32, name
            assert rel_err(got[2][name], grad) < TOL, name


@pytest.mark.parametrize("options", CONFIGS, ids=CONFIG_IDS)
def test_layer_forward_backward_bf16(device, routed, expert_params, cast, rel_err, options):
    """bfloat16 storage, float32 accumulation: within bfloat16 round-off (unit round-off
    2^-9, a few roundings per stage) of the float64 layer on the same bf16-representable
    inputs. On CPU the interpreter multiplies in float32 (its bfloat16 dot is wrong), so
    there this checks the bfloat16 loads, stores and rounding points; on a GPU the dots
    run on bfloat16 tensor cores."""
    config = MoEConfig(hidden_size=routed.x.shape[1], ffn_size=expert_params("glu", False, "cpu")["down_proj"].shape[2],
                       num_experts=6, top_k=2, **options)
    gen = torch.Generator().manual_seed(12)
    gate_weight = torch.randn(config.hidden_size, config.num_experts, generator=gen, dtype=F64).to(device)
    bf16 = torch.bfloat16
    x, gate_weight, params = cast(cast((routed.x, gate_weight, expert_params(config.expert, config.bias, device)),
                                       bf16), F64)
    grad_out = routed.grad_out.to(bf16)
    grad_loss = torch.tensor(1.0, dtype=F64, device=device)
    if config.activation == "clamped_swiglu":
        # Its derivative jumps at the limit: bfloat16's rounding of h moves elements across it, where
        # the float64 layer's derivative differs by O(1) (the torch path in bfloat16 is ~3e-2 from it
        # on these shapes too). Its reference is the torch path in bfloat16, whose backward reads the
        # same saved bf16 h (the forward computes a from float32 in the kernel, from bf16 h in torch):
        # two bf16 computations rounding in different places. With three 16-row tiles in an expert and two
        # column tiles (conftest), both are 2.6e-2 to 4.7e-2 from float64 on x and gate_up_proj(_bias),
        # and measured 5.1e-3 (output) and at most 3.1e-2 (gate_up_proj_bias) apart, held to 4e-2.
        with settings.override(kernels=False):
            expected = fused_operator(*cast((x, gate_weight, params), bf16), config, grad_out, grad_loss.to(F32))
        bound = 4e-2
    else:  # measured at most 6.5e-3 (output) and 1.2e-2 (gradients) from float64
        expected = fused_operator(x, gate_weight, params, config, grad_out.to(F64), grad_loss)
        bound = 2e-2
    got = kernel_moe(*cast((x, gate_weight, params), bf16), config, grad_out, grad_loss.to(F32))

    assert torch.equal(got[3].row_pair, expected[3].row_pair)
    assert got[0].dtype == F32 and rel_err(got[0], expected[0]) < bound
    for name, grad in expected[2].items():
        if grad is not None and name not in ("x", "gate_weight"):  # those two come back in float32
            assert got[2][name].dtype == bf16, name
        if grad is not None:
            assert rel_err(got[2][name], grad) < bound, name
