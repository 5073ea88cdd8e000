"""backends.select: one backend per forward, kept for its backward; every stage of the fused layer
runs through it."""
import pytest
import torch

import shardmoe
from shardmoe import kernels, settings
from shardmoe.moe import backends, function
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.cpu import CpuPasses
from shardmoe.moe.cpu import Workspace


PROTOCOL = {name for name in vars(backends.Backend) if not name.startswith("_")} | {"name", "workspace", "passes"}


def test_cpu_tensors_get_the_torch_backend_with_the_forwards_passes():
    config = MoEConfig(8, 6, 4, 2)
    x = torch.zeros(3, 8)
    chosen = backends.select(config, x)
    assert chosen.name == "torch" and chosen.workspace is None and chosen.passes == CpuPasses.decide(x)
    assert backends.select(config, x.double()).passes == CpuPasses()  # float64: no C++ pass takes it
    with settings.override(fused_elementwise=False, experts_mm=False):
        assert backends.select(config, x).passes == CpuPasses()
    ws = Workspace()
    bound = backends.select(config, x, ws)
    assert bound.name == "torch" and bound.workspace is ws


def test_off_the_cpu_the_torch_backend_takes_no_workspace():
    """Off the CPU (here the meta device stands in for a GPU) the torch backend allocates its rows, so
    its GEMMs are grouped_mm's (a GEMM into a workspace buffer runs a loop over experts)."""
    x = torch.zeros(3, 8, device="meta")
    chosen = backends.select(MoEConfig(8, 6, 4, 2), x, Workspace())
    assert chosen.name == "torch" and chosen.workspace is None


@pytest.mark.parametrize("expert,bias,dtype", [("glu", False, torch.float32), ("glu", True, torch.bfloat16),
                                                ("mlp", True, torch.float32)], ids=["glu", "glu-bias-bf16", "mlp-bias"])
def test_the_passes_are_decided_once_per_forward_and_once_per_backward(monkeypatch, expert, bias, dtype):
    """Every stage of a layer's forward and backward (shared experts included) uses the decision its
    backend carries: a stage that decided again would add a decision."""
    x = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    expected = CpuPasses.decide(x)
    decisions = []
    decide = CpuPasses.decide.__func__

    def counting(cls, tensor):
        decisions.append(decide(cls, tensor))
        return decisions[-1]

    monkeypatch.setattr(CpuPasses, "decide", classmethod(counting))
    torch.manual_seed(0)
    shared = dict(shared_ffn_size=4, shared_gate=True) if expert == "glu" else {}
    layer = shardmoe.MoE(8, 6, 4, 2, expert=expert, bias=bias, dtype=dtype, **shared)
    layer(x).float().sum().backward()
    assert decisions == [expected, expected]


def test_every_backend_implements_the_whole_protocol():
    assert {"expert_forward", "gathered_backward", "grad_input_combine"} <= PROTOCOL
    assert PROTOCOL <= set(dir(backends.TorchBackend))
    pytest.importorskip("triton")
    from shardmoe.moe.triton_backend import TritonBackend

    assert PROTOCOL <= set(dir(TritonBackend))


@pytest.mark.skipif(not kernels.triton_importable(), reason="triton cannot be imported")
def test_kernels_take_every_layer_kind():
    x = torch.zeros(3, 8)
    with kernels.force_kernel_path():  # fused_path then accepts CPU tensors
        assert backends.select(MoEConfig(8, 6, 4, 2), x).name == "triton"
        assert backends.select(MoEConfig(8, 6, 4, 2, expert="mlp", bias=True), x).name == "triton"
        assert backends.select(MoEConfig(8, 6, 4, 2, bias=True), x, Workspace()).name == "triton"
    assert backends.select(MoEConfig(8, 6, 4, 2), x).name == "torch"


# the torch backend's own stage 1, 3 and 4 functions, which its expert_backward calls on itself
TORCH_STAGES = {"grad_post_gemm_glu", "grad_pre_gemm_glu", "grad_post_gemm_mlp", "grad_pre_gemm_mlp", "grad_combine"}


class _Recording(backends.TorchBackend):
    """The torch backend, noting the name of every protocol method and stage function called on it."""

    def __init__(self, workspace, calls):
        super().__init__(workspace)
        self.calls = calls

    def __getattribute__(self, name):
        if name in (PROTOCOL | TORCH_STAGES) - {"name", "workspace", "passes"}:
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("expert", ["glu", "mlp"])
def test_every_stage_runs_on_the_backend_chosen_in_forward(monkeypatch, expert):
    calls, widths = [], []

    def recording(config, x, workspace=None, expert_width=None):
        widths.append(expert_width)
        return _Recording(workspace, calls)

    monkeypatch.setattr(backends, "select", recording)
    layer = shardmoe.MoE(8, 6, 4, 2, expert=expert, dtype=torch.float64)
    layer(torch.randn(5, 8, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert widths == [6, 6]  # forward and backward, each with the width of the GEMMs this rank runs
    # under expert tensor parallelism that is the rank's share of F: the down projection it holds
    config, F = layer.config, 6
    assert function.local_width(config, {config.kind.down: torch.empty(4, 8, F // 2)}) == F // 2  # [E, H, F/t]
    stages = {"gathered_forward", "expert_forward", "combine", "gathered_backward", "expert_backward",
              "grad_gate_combine", "grad_input_combine"}
    stages |= {"grad_post_gemm_glu", "grad_pre_gemm_glu"} if expert == "glu" else \
        {"grad_post_gemm_mlp", "grad_pre_gemm_mlp", "grad_combine"}
    assert set(calls) == stages
