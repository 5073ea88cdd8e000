"""The layer's kernel path (moe/triton_ops.py, its expert stages reading token-order tensors through
row_index), wired into the MoE operators and expert parallelism's expert stages, run on CPU in
Triton's interpreter by the force_kernels setting.

Each case runs shardmoe.MoE in float32 through the kernel path and compares the output, the aux
loss and every gradient with the independent float64 reference (moe/reference.py), 1e-5
relative; a spy checks that the kernels' expert stages ran and the torch expert stages did not."""
import pytest
import torch

import shardmoe
from shardmoe import kernels, settings
from shardmoe.mesh import Mesh
from shardmoe.moe import dispatch
from shardmoe.moe import experts as ex
from shardmoe.moe.reference import reference_forward_backward

pytestmark = pytest.mark.skipif(not kernels.triton_importable(),
                                reason="triton cannot be imported; install triton==3.9.0 to run the kernel tests")

H, F, E, K = 40, 24, 6, 2
TOL = 1e-5


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the kernels' expert stages reading token-order tensors through row_index (the
    local dispatcher's) and of the torch expert stages."""
    from shardmoe.moe.triton_ops import TritonOps

    calls = {"forward_gathered": 0, "backward_gathered": 0, "torch_forward": 0, "torch_backward": 0}

    def counting(cls, name, key):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            if key in calls:
                calls[key] += 1
            elif kwargs.get("row_index") is not None:
                calls[key + "_gathered"] += 1
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, wrapped)

    counting(TritonOps, "expert_forward", "forward")
    counting(TritonOps, "expert_backward", "backward")
    counting(ex.TorchOps, "expert_forward", "torch_forward")
    counting(ex.TorchOps, "expert_backward", "torch_backward")
    return calls


def _layers(options, empty_expert=None):
    """(float32 layer, float64 layer) with the same O(1) weights; `empty_expert` never wins."""
    torch.manual_seed(0)
    layer64 = shardmoe.MoE(H, F, E, K, dtype=torch.float64, **options)
    with torch.no_grad():
        for p in layer64.parameters():
            p.normal_(0, 0.3)
        if empty_expert is not None:  # a constant feature with a large negative gate weight
            layer64.gate_weight[0, empty_expert] = -30.0
    layer = shardmoe.MoE(H, F, E, K, **options)
    layer.load_state_dict({k: v.float() if v.dtype == torch.float64 else v for k, v in layer64.state_dict().items()})
    return layer, layer64


def _inputs(num_tokens):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, H, generator=gen, dtype=torch.float64)
    x[:, 0] = 3.0
    return x, torch.randn(num_tokens, H, generator=gen, dtype=torch.float64)


def _rel(actual, expected):
    scale = expected.abs().max().item()
    diff = (actual.double() - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


CASES = {
    "glu-silu-capacity-aux-z": dict(expert="glu", activation="silu", capacity_factor=0.75, aux_loss_coef=0.1,
                                    z_loss_coef=0.01),
    "mlp-gelu-bias-capacity": dict(expert="mlp", activation="gelu", output_activation="gelu_tanh", bias=True,
                                   capacity_factor=1.0, aux_loss_coef=0.1),
    "glu-deepseek-router": dict(expert="glu", activation="silu", score_func="sigmoid", router_bias=True,
                                correction_bias=True, n_group=3, topk_group=2, renormalize_epsilon=1e-20,
                                routed_scaling_factor=2.5, seq_aux_loss_coef=0.05),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_path_matches_float64_reference(spy, name):
    options = CASES[name]
    layer, layer64 = _layers(options, empty_expert=4)
    if options.get("correction_bias"):
        with torch.no_grad():
            layer.correction_bias.copy_(torch.linspace(-0.2, 0.2, E))
            layer64.correction_bias.copy_(layer.correction_bias)
    x, grad_out = _inputs(25)
    x32 = x.float().requires_grad_()
    with settings.override(force_kernels=True):
        out = layer(x32)
        out.backward(grad_out.float())  # the aux loss's gradient rides on out's backward
    assert spy == {"forward_gathered": 1, "backward_gathered": 1, "torch_forward": 0, "torch_backward": 0}
    assert layer.stats["tokens_per_expert"][4] == 0  # an empty expert group
    if options.get("capacity_factor"):
        assert layer.stats["dropped_tokens"] > 0

    params64 = {k: v.detach() for k, v in layer64.named_parameters()}
    correction = layer64.correction_bias if options.get("correction_bias") else None
    ref_out, ref_aux, ref_grads = reference_forward_backward(x, params64, layer64.config, grad_out, correction)
    assert _rel(out, ref_out) < TOL
    assert _rel(layer.aux_loss, ref_aux) < TOL
    assert _rel(x32.grad, ref_grads["x"]) < TOL
    for pname, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, pname
        assert _rel(p.grad, ref_grads[pname]) < TOL, pname


# Every expert kind the torch path runs, without balance losses (the output's gradient is then the
# whole of the reference's): GPT-OSS's experts (glu biases, the clamped SwiGLU with a limit that
# clamps both halves, its router bias, capacity drops), and shared experts beside the routed ones
# (gated, Qwen2-MoE; ungated beside "mlp" experts with biases), which run on torch.
KINDS = {
    "glu-bias-clamped-swiglu-router-bias-capacity": dict(expert="glu", activation="clamped_swiglu",
                                                         swiglu_limit=1.0, bias=True, router_bias=True,
                                                         capacity_factor=1.0),
    "glu-shared-gated": dict(expert="glu", activation="gelu", shared_ffn_size=16, shared_gate=True),
    "mlp-bias-shared": dict(expert="mlp", activation="silu", bias=True, shared_ffn_size=16),
}


def _check_against_reference(layer, layer64, x, x32, out, grad_out):
    params64 = {k: v.detach() for k, v in layer64.named_parameters()}
    ref_out, _, ref_grads = reference_forward_backward(x, params64, layer64.config, grad_out)
    assert _rel(out, ref_out) < TOL
    assert _rel(x32.grad, ref_grads["x"]) < TOL
    for pname, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, pname
        assert p.grad.abs().max() > 0, pname  # every parameter takes part
        assert _rel(p.grad, ref_grads[pname]) < TOL, pname


@pytest.mark.parametrize("name", KINDS)
def test_every_expert_kind_on_the_kernel_path(spy, name):
    """The routed experts run on the kernels' expert stages through row_index (never the torch expert
    stages) for every expert kind; the shared expert's dense GEMMs run on torch beside them. Output
    and every gradient within 1e-5 of the float64 reference."""
    layer, layer64 = _layers(KINDS[name], empty_expert=4)
    x, grad_out = _inputs(25)
    x32 = x.float().requires_grad_()
    with settings.override(force_kernels=True):
        out = layer(x32)
        out.backward(grad_out.float())
    assert spy == {"forward_gathered": 1, "backward_gathered": 1, "torch_forward": 0, "torch_backward": 0}
    assert layer.stats["tokens_per_expert"][4] == 0
    if KINDS[name].get("capacity_factor"):
        assert layer.stats["dropped_tokens"] > 0
    _check_against_reference(layer, layer64, x, x32, out, grad_out)


def test_expert_parallel_dispatcher_takes_the_kernel_path(spy, monkeypatch):
    """Expert parallelism's dispatcher (parallel/expert_parallel.py) on a one-rank mesh, in one
    process (the placement picks LOCAL for one rank, so it is put in by hand): its expert stages
    run on the kernels' expert stages on dispatched rows, and the layer matches the float64 reference."""
    from shardmoe.moe.triton_ops import TritonOps
    from shardmoe.parallel.expert_parallel import ExpertParallel

    calls = {"forward": 0, "backward": 0}
    for method, key in (("expert_forward", "forward"), ("expert_backward", "backward")):
        def wrapped(self, *args, _original=getattr(TritonOps, method), _key=key, **kwargs):
            assert kwargs.get("row_index") is None  # rows arrived dispatched
            calls[_key] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(TritonOps, method, wrapped)
    options = KINDS["glu-bias-clamped-swiglu-router-bias-capacity"]
    _, layer64 = _layers(options, empty_expert=4)
    layer = shardmoe.MoE(H, F, E, K, mesh=Mesh(), **options)
    layer.load_state_dict({k: v.float() for k, v in layer64.state_dict().items()})
    layer.placement.dispatcher = ExpertParallel(layer.config, layer.mesh)
    x, grad_out = _inputs(25)
    x32 = x.float().requires_grad_()
    with settings.override(force_kernels=True):
        out = layer(x32)
        out.backward(grad_out.float())
    assert calls == {"forward": 1, "backward": 1}
    assert spy == {"forward_gathered": 0, "backward_gathered": 0, "torch_forward": 0, "torch_backward": 0}
    assert layer.stats["dropped_tokens"] > 0
    _check_against_reference(layer, layer64, x, x32, out, grad_out)


@pytest.mark.parametrize("expert", ["glu", "mlp"])
def test_kernel_path_with_no_tokens(spy, expert):
    layer, _ = _layers(dict(expert=expert, bias=expert == "mlp"))
    x = torch.zeros(0, H, requires_grad=True)
    with settings.override(force_kernels=True):
        out = layer(x)
        out.sum().backward()
    assert out.shape == (0, H) and x.grad.shape == (0, H)
    assert spy["forward_gathered"] == 1 and spy["backward_gathered"] == 1
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())


def test_kernel_path_not_taken_for_float64(spy):
    """kernel_path refuses what the kernels do not take (float64); the layer then runs torch."""
    _, layer64 = _layers(dict(expert="glu", bias=True))
    x, grad_out = _inputs(9)
    with settings.override(force_kernels=True):
        layer64(x).backward(grad_out)
    assert spy == {"forward_gathered": 0, "backward_gathered": 0, "torch_forward": 1, "torch_backward": 1}


@pytest.mark.parametrize("options", [dict(expert="glu"), dict(expert="mlp", bias=True),
                                     dict(expert="glu", bias=True, activation="clamped_swiglu", swiglu_limit=1.0)],
                         ids=["glu", "mlp-bias", "glu-bias-clamped"])
def test_expert_parallel_backward_stage_equals_torch_stage(options):
    """parallel.expert_parallel._experts_backward on TritonOps (stages 1+2 or 2-4 fused)
    equals the torch stages on the same dispatched rows (a one-rank mesh: no communication)."""
    from shardmoe.parallel.expert_parallel import _experts_backward, _experts_forward
    layer, _ = _layers(options)
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 3, 9, 0, 4])
    groups = ex.Groups.from_counts(counts)
    rows = int(counts.sum())
    xs, grad_rows = torch.randn(rows, H, generator=gen), torch.randn(rows, H, generator=gen)
    weight_rows = torch.rand(rows, generator=gen) + 0.1
    params = {n: None if p is None else p.detach()
              for n, p in zip(layer.config.expert_param_names, layer.expert_parameters())}
    mesh = Mesh()
    _, saved = _experts_forward(ex.TORCH_OPS, layer.config, mesh, xs, params, groups)
    expected = _experts_backward(ex.TORCH_OPS, layer.config, mesh, grad_rows, weight_rows, xs, saved, params, groups)
    with settings.override(force_kernels=True):
        triton = dispatch.select(layer.config, xs)
    assert triton.name == "triton"
    got = _experts_backward(triton, layer.config, mesh, grad_rows, weight_rows, xs, saved, params, groups)
    assert _rel(got[0], expected[0].double()) < TOL
    assert _rel(got[1], expected[1].double()) < TOL
    for pname, grad in expected[2].items():
        if grad is None:
            assert got[2].get(pname) is None, pname
        else:
            assert _rel(got[2][pname], grad.double()) < TOL, pname
