"""A dropless step on the Triton path reads nothing from the device on the host: the MoE operators'
bodies, forward and backward (routing with the router's GEMM kernel, dispatch, TritonOps, the
router's backward), run on meta tensors, which hold shapes and no data, so any .item(), .tolist(),
.cpu(), int(t), bool(t), a boolean-mask index or a data-sized output (bincount, repeat_interleave
without its size) raises.
The kernel launches are recorded instead of run: what each launch needs from the host is then only
shapes (N = S k, E), never counts. On a GPU the same holds under torch.cuda.set_sync_debug_mode
("error"), which the lease's bench stage checks (docs/gpu.md)."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

from triton.runtime.autotuner import Autotuner  # noqa: E402

from shardmoe import kernels, settings  # noqa: E402
from shardmoe.moe.config import MoEConfig  # noqa: E402
from shardmoe.moe.dispatch import LOCAL  # noqa: E402
from shardmoe.moe import function  # noqa: E402
from shardmoe.moe.function import MoEContext  # noqa: E402
from shardmoe.moe.routing import GateRouter, GivenRouting  # noqa: E402

S, H, F, E, K = 48, 32, 16, 8, 2
META = dict(device="meta", dtype=torch.bfloat16)
ROUTER_FORWARD = ["router_gemm_kernel"]  # x Wg
ROUTER_BACKWARD = ["router_gemm_kernel", "router_gemm_kernel"]  # stage 6: dx = dlogits Wg^T, dWg = x^T dlogits
GLU_LAUNCHES = [*ROUTER_FORWARD, "forward_gemm_kernel", "forward_gemm_kernel", "token_combine_kernel",  # forward
                "down_grad_kernel", "weight_grad_kernel", "weight_grad_kernel", "grad_gemm_kernel",  # stages 2-4
                "token_combine_kernel", *ROUTER_BACKWARD]  # stages 5 and 6
MLP_LAUNCHES = [*ROUTER_FORWARD, "forward_gemm_kernel", "forward_gemm_kernel", "token_combine_kernel",
                "gate_dots_kernel", "grad_gemm_kernel", "weight_grad_kernel", "weight_grad_kernel",
                "grad_gemm_kernel", "token_combine_kernel", *ROUTER_BACKWARD]


class _Owner:
    """Gives the operators one MoEContext."""

    def __init__(self, context: MoEContext):
        self.context = context

    def moe_context(self, x, inputs) -> MoEContext:
        return self.context


def _run(context: MoEContext, x: torch.Tensor, tensors: tuple):
    """(out, loss, [dx, gradients]) of the operators' bodies, called directly (the operators would
    send meta tensors to their fake implementations), every present input's gradient wanted."""
    owner = _Owner(context)
    handle = function.register(owner)
    present, absent = function.operator_inputs(tensors)
    out, loss, saved = function.moe_forward(handle, x, present, absent)
    grads = function.moe_backward(handle, torch.empty(S, H, **META), torch.ones((), device="meta"), x, present,
                                  absent, saved, [True] * len(present))
    return out, loss, grads


def step(config: MoEConfig, launched: list):
    """One forward and backward of the MoE operators' bodies on meta tensors, kernels forced (bf16)."""
    shapes = config.kind.whole_shapes(H, F, E)
    params = [torch.empty(shapes[n], **META) if n in shapes and (config.bias or n not in config.kind.bias_names)
              else None for n in config.expert_param_names]
    stats = []
    context = MoEContext(config, GateRouter(config), LOCAL, stats=stats.append, loss_scale=1.0)
    x = torch.empty(S, H, **META)
    tensors = (torch.empty(H, E, **META), None, None, None, *params)
    with settings.override(force_kernels=True):
        out, loss, grads = _run(context, x, tensors)
    return out, loss, grads, stats


@pytest.fixture
def launched(monkeypatch):
    calls = []

    def record(self, *args, grid=None, warmup=False, **kwargs):
        calls.append(self.fn.__name__)

    monkeypatch.setattr(Autotuner, "run", record)
    return calls


@pytest.mark.parametrize("options,expected", [
    (dict(expert="glu", activation="silu", aux_loss_coef=0.01, z_loss_coef=0.001), GLU_LAUNCHES),
    (dict(expert="glu", activation="clamped_swiglu", bias=True), GLU_LAUNCHES),
    (dict(expert="mlp", activation="gelu", bias=True), MLP_LAUNCHES)], ids=["glu-aux-z", "glu-bias-clamped", "mlp-bias"])
def test_a_dropless_step_reads_nothing_from_the_device(launched, options, expected):
    out, loss, grads, stats = step(MoEConfig(H, F, E, K, **options), launched)
    assert launched == expected
    assert out.shape == (S, H) and out.device.type == "meta" and loss.shape == ()
    assert grads[0].shape == (S, H) and grads[1].shape == (H, E)  # dx, the gate weight's gradient
    assert stats[0]["dropped_tokens"].device.type == "meta"  # a tensor: reading it is the caller's wait


def test_a_step_through_the_transformers_seam_reads_nothing_from_the_device(launched):
    """The seam's routing is given (routing.GivenRouting: top_k_index, top_k_weights): its check of
    the expert ids runs on the device, and the rest of the step is the layer's own."""
    config = MoEConfig(H, F, E, K)
    shapes = config.kind.whole_shapes(H, F, E)
    params = [torch.empty(shapes[n], **META) if n in shapes and n not in config.kind.bias_names else None
              for n in config.expert_param_names]
    context = MoEContext(config, GivenRouting(E), LOCAL)
    x = torch.empty(S, H, **META)
    tensors = (torch.empty(S, K, device="meta", dtype=torch.int64), torch.empty(S, K, **META), *params)
    with settings.override(force_kernels=True):
        out, loss, grads = _run(context, x, tensors)
    assert launched == GLU_LAUNCHES[1:-2]  # no router GEMMs: the routing is given
    # dx, top_k_index's (zeros: an index has none), top_k_weights' (the gate dots)
    assert out.shape == (S, H) and grads[0].shape == (S, H) and grads[2].shape == (S, K)


def test_the_meta_step_catches_a_host_read(launched):
    """The check is not vacuous: capacity drops choose the kept rows by a boolean mask, whose size
    only the data knows (a host wait on a GPU), and on meta tensors that raises."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        step(MoEConfig(H, F, E, K, capacity_factor=1.0), launched)
