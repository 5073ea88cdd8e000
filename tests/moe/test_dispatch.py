"""dispatch.select: one set of ops per forward, decided again for its backward; every stage of the
layer runs on it."""
import pytest
import torch

import shardmoe
from shardmoe import kernels, settings
from shardmoe.moe import dispatch, function
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.cpu import CpuOps, Workspace
from shardmoe.moe.experts import TORCH_OPS, TorchOps

# what the operators and dispatchers call on the ops, and the row primitives the stage math calls
# (glu_backward_one_pass only where has_glu_backward_one_pass says so)
STAGES = {"expert_forward", "expert_backward", "combine", "grad_gate_combine", "grad_input_combine"}
PRIMITIVES = {name for name in vars(TorchOps) if not name.startswith("_")} - STAGES - {"name", "fills_row_buffers"} | {"glu_backward_one_pass"}


def _flags(ops: CpuOps) -> tuple[bool, bool]:
    return ops.elementwise, ops.side_by_side


def test_cpu_tensors_get_the_forwards_cpu_ops():
    config = MoEConfig(8, 6, 4, 2)
    x = torch.zeros(3, 8)
    chosen = dispatch.select(config, x)
    assert chosen.name == "torch" and isinstance(chosen, CpuOps) and chosen.workspace is None
    assert _flags(chosen) == _flags(CpuOps.decide(x))
    assert _flags(dispatch.select(config, x.double())) == (False, False)  # float64: no C++ pass takes it
    with settings.override(fused_elementwise=False, experts_mm=False):
        assert _flags(dispatch.select(config, x)) == (False, False)
    ws = Workspace()
    bound = dispatch.select(config, x, ws)
    assert bound.name == "torch" and bound.workspace is ws


def test_off_the_cpu_the_torch_ops_are_torchs_own():
    """Off the CPU (here the meta device stands in for a GPU) the torch stages allocate their rows, so
    their GEMMs are grouped_mm's (a GEMM into a workspace buffer runs a loop over experts)."""
    x = torch.zeros(3, 8, device="meta")
    assert dispatch.select(MoEConfig(8, 6, 4, 2), x, Workspace()) is TORCH_OPS


@pytest.mark.parametrize("expert,bias,dtype", [("glu", False, torch.float32), ("glu", True, torch.bfloat16),
                                                ("mlp", True, torch.float32)], ids=["glu", "glu-bias-bf16", "mlp-bias"])
def test_the_cpu_ops_are_decided_once_per_forward_and_once_per_backward(monkeypatch, expert, bias, dtype):
    """Every stage of a layer's forward and backward (shared experts included) uses the decision its
    ops carry: a stage that decided again would add a decision."""
    x = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    expected = _flags(CpuOps.decide(x))
    decisions = []
    decide = CpuOps.decide.__func__

    def counting(cls, tensor, workspace=None):
        decisions.append(decide(cls, tensor, workspace))
        return decisions[-1]

    monkeypatch.setattr(CpuOps, "decide", classmethod(counting))
    torch.manual_seed(0)
    shared = dict(shared_ffn_size=4, shared_gate=True) if expert == "glu" else {}
    layer = shardmoe.MoE(8, 6, 4, 2, expert=expert, bias=bias, dtype=dtype, **shared)
    layer(x).float().sum().backward()
    assert [_flags(d) for d in decisions] == [expected, expected]


def test_the_triton_ops_run_the_stages_and_keep_torchs_primitives():
    """TritonOps replaces every stage the operators and dispatchers call and no row primitive: the
    shared expert's stage math runs on torch's own primitives beside the kernels."""
    assert STAGES <= set(vars(TorchOps))
    pytest.importorskip("triton")
    from shardmoe.moe.triton_ops import TritonOps

    overridden = {name for name in vars(TritonOps) if not name.startswith("_")}
    assert overridden == STAGES | {"name"}


@pytest.mark.skipif(not kernels.triton_importable(), reason="triton cannot be imported")
def test_kernels_take_every_layer_kind():
    x = torch.zeros(3, 8)
    with settings.override(force_kernels=True):  # kernel_path then accepts CPU tensors
        assert dispatch.select(MoEConfig(8, 6, 4, 2), x).name == "triton"
        assert dispatch.select(MoEConfig(8, 6, 4, 2, expert="mlp", bias=True), x).name == "triton"
        assert dispatch.select(MoEConfig(8, 6, 4, 2, bias=True), x, Workspace()).name == "triton"
    assert dispatch.select(MoEConfig(8, 6, 4, 2), x).name == "torch"


@pytest.mark.parametrize("expert,dtype", [("glu", torch.float64), ("glu", torch.float32), ("mlp", torch.float64)])
def test_every_stage_runs_on_the_ops_chosen_in_forward(monkeypatch, expert, dtype):
    """Each stage the layer calls and every row primitive any stage calls (shared expert included)
    is a method of the ops select() chose for that forward or backward: none reaches for another."""
    chosen, widths, calls = [], [], []
    select = dispatch.select

    def recording(config, x, workspace=None, expert_width=None):
        widths.append(expert_width)
        chosen.append(select(config, x, workspace, expert_width))
        return chosen[-1]

    for cls in (TorchOps, CpuOps):
        for name in (STAGES | PRIMITIVES) & set(vars(cls)):
            method = vars(cls)[name]
            monkeypatch.setattr(cls, name, lambda self, *a, _n=name, _m=method, **k:
                                (calls.append((_n, self)), _m(self, *a, **k))[1])
    monkeypatch.setattr(dispatch, "select", recording)
    shared = dict(shared_ffn_size=4, shared_gate=True) if expert == "glu" else {}
    layer = shardmoe.MoE(8, 6, 4, 2, expert=expert, dtype=dtype, **shared)
    layer(torch.randn(5, 8, dtype=dtype, requires_grad=True)).sum().backward()
    assert widths == [6, 6]  # forward and backward, each with the width of the GEMMs this rank runs
    # under expert tensor parallelism that is the rank's share of F: the down projection it holds
    config, F = layer.config, 6
    assert function.local_width(config, {config.kind.down: torch.empty(4, 8, F // 2)}) == F // 2  # [E, H, F/t]
    assert len(chosen) == 2 and calls and all(any(ops is c for c in chosen) for _, ops in calls)
    used = {name for name, _ in calls}
    assert {"expert_forward", "combine", "expert_backward", "grad_input_combine"} <= used
    assert {"empty", "linear", "linear_t", "weight_grad", "scale_rows", "rowwise_dot", "combine_rows"} <= used
    if expert == "glu":
        fused = CpuOps.decide(torch.zeros(1, dtype=dtype)).elementwise
        one_pass = {"glu_backward_one_pass"} if fused else {"glu_backward"}
        assert {"glu", "has_glu_backward_one_pass"} | one_pass <= used
