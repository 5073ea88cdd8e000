"""The seam between the MoE Function and the implementations of its expert and combine stages.

A backend implements every method of the Backend protocol below; the MoE Function and the
dispatchers call nothing else. Two families of entry points:

  on dispatched rows   expert_forward, expert_backward       (expert parallelism: the rows arrived
                                                              over the exchange, y goes back over it)
  on token order       gathered_forward, gathered_backward   (the local dispatcher: x and grad_out
                                                              in token order with row_token [N]; a
                                                              backend may fuse the gather and the
                                                              combine into its GEMMs)
  combine side         combine, grad_gate_combine (stage 2),
                       grad_input_combine (stage 5)

select() makes the one decision per forward, and again for its backward from the same config, input
and weights (the operators carry no Python objects from one to the other), so the two agree unless
a setting changes in between; either way the results agree to round-off. The backends:

  torch   TorchBackend: the stage functions of moe/experts.py and moe/combine.py (any device torch
          runs on; its expert_backward runs stages 1, 3 and 4 through its own grad_combine,
          grad_post_gemm_glu, grad_pre_gemm_glu, grad_post_gemm_mlp and grad_pre_gemm_mlp), with, on CPU, its row
          buffers from the layer's workspace and the C++ passes and side-by-side GEMMs of
          moe/cpu.py that the forward's CpuPasses allows (decided in select(); each stage then
          checks only that its operands fit); on a GPU fresh buffers, so that its GEMMs are
          grouped_mm's
  triton  TritonBackend (moe/triton_backend.py): the Triton kernels of shardmoe/kernels, chosen for
          CUDA tensors of a kernel dtype when the config has only what the kernels implement
          (kernels.fused_path)

A new implementation is a class providing every method of Backend and one condition in select().
"""
from __future__ import annotations

from typing import Protocol

import torch

from shardmoe import kernels
from shardmoe.expert_kinds import ExpertKind
from shardmoe.moe import combine as comb
from shardmoe.moe import experts as ex
from shardmoe.moe.activations import ClampedSwiGLU
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.cpu import CpuPasses
from shardmoe.moe.cpu import Workspace, empty_rows
from shardmoe.rows import Groups

Activation = str | ClampedSwiGLU


class Backend(Protocol):
    """What the MoE Function and the dispatchers call. Shapes: S tokens, N dispatched rows, H
    hidden; `kind` is the expert kind (shardmoe/expert_kinds.py: GLU or MLP); `saved` is what the
    forward entry points return for backward, kind.saved(...) (GLU: (h [N, 2F],); MLP:
    (z1 [N, P], z2 [N, H])); gradients come as {parameter name: gradient}."""

    name: str
    workspace: Workspace | None
    passes: CpuPasses | None

    def expert_forward(self, kind: ExpertKind, activation: Activation, output_activation: str, xs: torch.Tensor,
                       params: dict, groups: Groups) -> tuple[torch.Tensor, tuple]:
        """y [N, H] for rows xs [N, H], and saved."""

    def expert_backward(self, kind: ExpertKind, activation: Activation, output_activation: str,
                        grad_rows: torch.Tensor, weight_rows: torch.Tensor, xs: torch.Tensor, saved: tuple, params: dict,
                        groups: Groups) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Stages 1-4 on rows: (dx rows [N, H], gate dots dw [N] acc dtype, gradients)."""

    def gathered_forward(self, kind: ExpertKind, activation: Activation, output_activation: str, x: torch.Tensor,
                         row_token: torch.Tensor, weight_rows: torch.Tensor, row_pair: torch.Tensor, top_k: int,
                         params: dict, groups: Groups) -> tuple[torch.Tensor, tuple]:
        """out [S, H] acc dtype = sum over kept pairs of w_r y(x[row_token[r]]), and saved."""

    def gathered_backward(self, kind: ExpertKind, activation: Activation, output_activation: str,
                          grad_out: torch.Tensor, weight_rows: torch.Tensor, x: torch.Tensor, row_token: torch.Tensor, saved: tuple,
                          params: dict, groups: Groups) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Stages 1-4 with grad_out [S, H] and x [S, H] read through row_token [N]: as expert_backward."""

    def combine(self, expert_out: torch.Tensor, weight_rows: torch.Tensor, row_pair: torch.Tensor,
                num_tokens: int, top_k: int) -> torch.Tensor: ...

    def grad_gate_combine(self, grad_rows: torch.Tensor, out_rows: torch.Tensor,
                          out_scale: torch.Tensor | None = None) -> torch.Tensor: ...

    def grad_input_combine(self, dx_rows: torch.Tensor, row_pair: torch.Tensor, num_tokens: int,
                           top_k: int) -> torch.Tensor: ...


def gather_rows(tokens: torch.Tensor, row_token: torch.Tensor, workspace: Workspace | None) -> torch.Tensor:
    """tokens[row_token]: [S, D], [N] -> [N, D], into a workspace buffer when one is given."""
    out = empty_rows(workspace, (row_token.shape[0], tokens.shape[1]), tokens)
    return torch.index_select(tokens, 0, row_token, out=out)


class TorchBackend:
    """The stage functions of moe/experts.py and moe/combine.py; the large row buffers they return
    come from `workspace` (None: fresh allocations), and `passes` is the forward's decision of
    which C++ passes they may use on CPU (None: each stage decides at its call, for callers outside
    a layer's forward). The gathered entry points gather x[row_token] and grad_out[row_token] into
    workspace buffers and combine y after the GEMMs."""

    name = "torch"
    workspace: Workspace | None = None
    passes: CpuPasses | None = None

    def __init__(self, workspace: Workspace | None = None, passes: CpuPasses | None = None):
        self.workspace, self.passes = workspace, passes

    def expert_forward(self, kind, activation, output_activation, xs, params, groups):
        return ex.expert_forward(kind, activation, output_activation, xs, params, groups, workspace=self.workspace,
                                 passes=self.passes)

    def expert_backward(self, kind, activation, output_activation, grad_rows, weight_rows, xs, saved, params,
                        groups):
        return ex.expert_backward(kind, activation, output_activation, grad_rows, weight_rows, xs, saved, params,
                                  groups, stages=self, workspace=self.workspace, one_pass=True, passes=self.passes)

    def gathered_forward(self, kind, activation, output_activation, x, row_token, weight_rows, row_pair, top_k,
                         params, groups):
        y, saved = self.expert_forward(kind, activation, output_activation,
                                       gather_rows(x, row_token, self.workspace), params, groups)
        return self.combine(y, weight_rows, row_pair, x.shape[0], top_k), saved

    def gathered_backward(self, kind, activation, output_activation, grad_out, weight_rows, x, row_token, saved,
                          params, groups):
        return self.expert_backward(kind, activation, output_activation,
                                    gather_rows(grad_out, row_token, self.workspace), weight_rows,
                                    gather_rows(x, row_token, self.workspace), saved, params, groups)

    def combine(self, expert_out, weight_rows, row_pair, num_tokens, top_k):
        return comb.combine(expert_out, weight_rows, row_pair, num_tokens, top_k, passes=self.passes)

    def grad_combine(self, grad_rows, weight_rows):
        return comb.grad_combine(grad_rows, weight_rows, workspace=self.workspace, passes=self.passes)

    def grad_gate_combine(self, grad_rows, out_rows, out_scale=None):
        return comb.grad_gate_combine(grad_rows, out_rows, out_scale, passes=self.passes)

    def grad_input_combine(self, dx_rows, row_pair, num_tokens, top_k):
        return comb.grad_input_combine(dx_rows, row_pair, num_tokens, top_k, passes=self.passes)

    def grad_post_gemm_glu(self, grad_rows, weight_rows, a, down_proj, groups, has_bias=False):
        return ex.grad_post_gemm_glu(grad_rows, weight_rows, a, down_proj, groups, has_bias, workspace=self.workspace,
                                     passes=self.passes)

    def grad_pre_gemm_glu(self, grad_a, h, act_gate, xs, gate_up_proj, groups, activation, has_bias=False):
        return ex.grad_pre_gemm_glu(grad_a, h, act_gate, xs, gate_up_proj, groups, activation, has_bias,
                                    workspace=self.workspace, passes=self.passes)

    def grad_post_gemm_mlp(self, grad_expert, z2, a1, w2, has_bias, groups, output_activation):
        return ex.grad_post_gemm_mlp(grad_expert, z2, a1, w2, has_bias, groups, output_activation, passes=self.passes)

    def grad_pre_gemm_mlp(self, grad_a1, z1, xs, w1, has_bias, groups, activation):
        return ex.grad_pre_gemm_mlp(grad_a1, z1, xs, w1, has_bias, groups, activation, passes=self.passes)


def select(config: MoEConfig, x: torch.Tensor, workspace: Workspace | None = None,
           expert_width: int | None = None) -> Backend:
    """The backend for one forward of a layer with `config` on input x [S, H]: Triton when
    kernels.fused_path(config, x, expert_width) (a CUDA tensor of a kernel dtype, or any under the
    test switch kernels.force_kernel_path(); triton importable; kernels not switched off in
    shardmoe.settings; experts at most kernels.KERNEL_MAX_FFN wide, `expert_width` being the width
    this rank computes); torch otherwise, using the C++ passes that CpuPasses.decide(x) allows and
    drawing its row buffers from `workspace` on CPU only: the pool exists for the CPU allocator's
    page faults (moe/cpu.py), and on a GPU a GEMM into a given buffer would leave grouped_mm
    (which allocates its output) for a loop over experts. The kernels allocate their own. On CPU
    the kernels are not consulted unless that test switch is on (their interpreter is a test
    vehicle)."""
    on_cpu = x.device.type == "cpu"
    if (not on_cpu or kernels.FORCED) and kernels.fused_path(config, x, expert_width):
        from shardmoe.moe.triton_backend import TRITON  # imports triton: only when it runs

        return TRITON
    return TorchBackend(workspace if on_cpu else None, CpuPasses.decide(x))
