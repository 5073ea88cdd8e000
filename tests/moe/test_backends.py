"""backends.select: one backend per forward, kept for its backward; every stage of the fused layer
runs through it."""
import functools
from types import SimpleNamespace

import pytest
import torch

import shardmoe
from shardmoe import kernels
from shardmoe.moe import backends
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.workspace import Workspace


def test_cpu_tensors_get_the_torch_backend():
    config = MoEConfig(8, 6, 4, 2)
    x = torch.zeros(3, 8)
    assert backends.select(config, x) is backends.TORCH
    ws = Workspace()
    bound = backends.select(config, x, ws)
    assert bound.name == "torch" and bound.workspace is ws
    assert bound.expert_forward.keywords == {"workspace": ws}
    assert set(backends.STAGES) <= set(vars(bound))


@pytest.mark.skipif(not kernels.triton_importable(), reason="triton cannot be imported")
def test_kernels_take_the_layer_unless_it_has_glu_biases():
    x = torch.zeros(3, 8)
    with kernels.force_kernel_path():  # fused_path then accepts CPU tensors
        assert backends.select(MoEConfig(8, 6, 4, 2), x).name == "triton"
        assert backends.select(MoEConfig(8, 6, 4, 2), x).fused_gather
        assert backends.select(MoEConfig(8, 6, 4, 2, expert="mlp", bias=True), x).name == "triton"
        assert backends.select(MoEConfig(8, 6, 4, 2, bias=True), x, Workspace()).name == "torch"
    assert backends.select(MoEConfig(8, 6, 4, 2), x).name == "torch"


@pytest.mark.parametrize("expert", ["glu", "mlp"])
def test_every_stage_runs_on_the_backend_chosen_in_forward(monkeypatch, expert):
    calls = []

    def recording(config, x, workspace=None):
        base = backends._torch(workspace)
        stages = {s: _record(calls, s, getattr(base, s)) for s in backends.STAGES if s != "expert_backward"}
        backend = SimpleNamespace(name="recording", workspace=workspace, fused_gather=False, **stages)
        backend.expert_backward = _record(calls, "expert_backward", functools.partial(
            base.expert_backward.func, stages=backend, workspace=workspace))
        return backend

    monkeypatch.setattr(backends, "select", recording)
    layer = shardmoe.MoE(8, 6, 4, 2, expert=expert, dtype=torch.float64)
    layer(torch.randn(5, 8, dtype=torch.float64, requires_grad=True)).sum().backward()
    stages = {"expert_forward", "combine", "expert_backward", "grad_gate_combine", "grad_input_combine"}
    stages |= {"grad_post_gemm_glu", "grad_pre_gemm_glu"} if expert == "glu" else \
        {"grad_post_gemm_mlp", "grad_pre_gemm_mlp", "grad_combine"}
    assert set(calls) == stages


def _record(calls, name, fn):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapper
