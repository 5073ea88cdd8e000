"""The seam between the MoE layers and the implementations of their stages.

A backend is one implementation of the stage functions, with their names, signatures and
semantics (docstrings in shardmoe/moe/experts.py and combine.py):

  expert forward      expert_forward
  expert backward     expert_backward (stages 1-4, built from the five below; the torch backend runs
                      glu's elementwise work of stages 2-4 as one CPU pass, experts.py)
  stage 3 / 4         grad_post_gemm_glu, grad_pre_gemm_glu, grad_post_gemm_mlp, grad_pre_gemm_mlp
  combine side        combine, grad_combine (1), grad_gate_combine (2), grad_input_combine (5)

select() picks one backend per forward from the layer's config and input; FusedMoE and
ExpertParallelMoE keep it on ctx for their backward, so forward and backward never mix
implementations. Backends today:

  torch   shardmoe/moe/experts.py and combine.py themselves (CPU, and any device torch runs on)
  triton  the wrappers of shardmoe/kernels (CUDA tensors of a kernel dtype, kernels.fused_path()),
          with the fused entry points of kernels/layer_path.py (fused_gather: the layer hands the
          kernels x and grad_out in token order, no gathered copies, no stored y)

A new implementation is a new module providing these names and one condition in select().
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from shardmoe import kernels
from shardmoe.moe import combine as comb
from shardmoe.moe import experts as ex
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.workspace import Workspace

EXPERT_STAGES = ("expert_forward", "grad_post_gemm_glu", "grad_pre_gemm_glu", "grad_post_gemm_mlp",
                 "grad_pre_gemm_mlp")
COMBINE_STAGES = ("combine", "grad_combine", "grad_gate_combine", "grad_input_combine")
STAGES = (*EXPERT_STAGES, "expert_backward", *COMBINE_STAGES)


def _namespace(name: str, workspace: Workspace | None = None, expert_backward=None, **stages) -> SimpleNamespace:
    """A backend: `name` plus every stage; expert_backward, unless given, is composed from this
    backend's own stages. fused_gather (False unless given): whether the layer hands the stages x and
    grad_out in token order (expert_forward_combine, expert_backward(row_index=)) instead of
    gathering x[row_token] and combining y itself."""
    backend = SimpleNamespace(name=name, workspace=workspace, **{"fused_gather": False, **stages})
    backend.expert_backward = expert_backward or functools.partial(ex.expert_backward, stages=backend,
                                                                   workspace=workspace)
    return backend


# the stages that take a `workspace` keyword (the ones whose outputs are large row buffers)
WORKSPACE_STAGES = ("expert_forward", "grad_post_gemm_glu", "grad_pre_gemm_glu", "grad_combine")


def _torch(workspace: Workspace | None) -> SimpleNamespace:
    """The torch backend; with a workspace, its stages take their large row buffers from it."""
    stages = {s: getattr(ex, s) for s in EXPERT_STAGES} | {s: getattr(comb, s) for s in COMBINE_STAGES}
    if workspace is not None:
        stages.update({s: functools.partial(stages[s], workspace=workspace) for s in WORKSPACE_STAGES})
    return _namespace("torch", workspace, **stages)


TORCH = _torch(None)


@functools.cache
def _triton() -> SimpleNamespace:
    """The Triton backend, built on first use (importing shardmoe.kernels.combine imports triton)."""
    from shardmoe.kernels import combine as triton_combine
    from shardmoe.kernels import experts as triton_experts

    # The kernels take no glu biases (select() never picks them for a biased glu), so the torch
    # signatures' has_bias is always False here and the bias gradient None.
    def grad_post_gemm_glu(grad_rows, weight_rows, a, down_proj, groups, has_bias=False):
        return (*triton_experts.grad_post_gemm_glu(grad_rows, weight_rows, a, down_proj, groups), None)

    def grad_pre_gemm_glu(grad_a, h, act_gate, xs, gate_up_proj, groups, activation, has_bias=False):
        return (*triton_experts.grad_pre_gemm_glu(grad_a, h, act_gate, xs, gate_up_proj, groups, activation), None)

    def grad_gate_combine(grad_rows, out_rows, out_scale=None):
        return triton_combine.grad_gate_combine(grad_rows, out_rows if out_scale is None else out_rows * out_scale)

    from shardmoe.kernels import layer_path

    # the fused entry points (kernels/layer_path.py): the layer passes x and grad_out in token order
    # with row_token and the kernels gather inside; stages 1+2 (mlp) or 2+3 (glu) run as one kernel
    return _namespace("triton", expert_backward=layer_path.expert_backward, fused_gather=True,
                      expert_forward_combine=triton_experts.expert_forward_combine,
                      expert_forward=triton_experts.expert_forward,
                      grad_post_gemm_glu=grad_post_gemm_glu, grad_pre_gemm_glu=grad_pre_gemm_glu,
                      grad_post_gemm_mlp=triton_experts.grad_post_gemm_mlp,
                      grad_pre_gemm_mlp=triton_experts.grad_pre_gemm_mlp,
                      combine=triton_combine.combine, grad_combine=triton_combine.grad_combine,
                      grad_gate_combine=grad_gate_combine, grad_input_combine=triton_combine.grad_input_combine)


def select(config: MoEConfig, x: torch.Tensor, workspace: Workspace | None = None) -> SimpleNamespace:
    """The backend for one forward of a layer with `config` on input x [S, H]: Triton when
    kernels.fused_path(config, x) (a CUDA tensor of a kernel dtype, or any under the test switch
    force_kernel_path(); triton importable; SHARDMOE_KERNELS not 0; a config the kernels implement:
    no glu biases); torch otherwise, drawing its row buffers from `workspace` when one is given
    (the kernels allocate their own)."""
    if kernels.fused_path(config, x):
        return _triton()
    return TORCH if workspace is None else _torch(workspace)
