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

  torch   TorchBackend: the stage math of moe/experts.py and moe/combine.py on one set of row
          primitives, its `ops`: on CPU moe/cpu.py's CpuOps (the C++ passes and side-by-side GEMMs
          the forward allows, decided in select(), and row buffers from the layer's workspace;
          each primitive then checks only that its operands fit), on any other device
          experts.TorchOps (fresh buffers, so that its GEMMs are grouped_mm's)
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
from shardmoe.moe.cpu import CpuOps, Workspace
from shardmoe.rows import Groups

Activation = str | ClampedSwiGLU


class Backend(Protocol):
    """What the MoE Function and the dispatchers call. Shapes: S tokens, N dispatched rows, H
    hidden; `kind` is the expert kind (shardmoe/expert_kinds.py: GLU or MLP); `saved` is what the
    forward entry points return for backward, kind.saved(...) (GLU: (h [N, 2F],); MLP:
    (z1 [N, P], z2 [N, H])); gradients come as {parameter name: gradient}."""

    name: str
    ops: ex.TorchOps  # the row primitives of the torch stages it runs (shared experts: moe/function.py)

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


def gather_rows(ops: ex.TorchOps, tokens: torch.Tensor, row_token: torch.Tensor) -> torch.Tensor:
    """tokens[row_token]: [S, D], [N] -> [N, D], into a buffer of ops.empty."""
    return torch.index_select(tokens, 0, row_token, out=ops.empty((row_token.shape[0], tokens.shape[1]), tokens))


class TorchBackend:
    """The stage math of moe/experts.py and moe/combine.py on the row primitives `ops`. The gathered
    entry points gather x[row_token] and grad_out[row_token] into row buffers and combine y after
    the GEMMs."""

    name = "torch"

    def __init__(self, ops: ex.TorchOps = ex.TORCH_OPS):
        self.ops = ops

    def expert_forward(self, kind, activation, output_activation, xs, params, groups):
        return ex.expert_forward(self.ops, kind, activation, output_activation, xs, params, groups)

    def expert_backward(self, kind, activation, output_activation, grad_rows, weight_rows, xs, saved, params,
                        groups):
        return ex.expert_backward(self.ops, kind, activation, output_activation, grad_rows, weight_rows, xs, saved,
                                  params, groups)

    def gathered_forward(self, kind, activation, output_activation, x, row_token, weight_rows, row_pair, top_k,
                         params, groups):
        y, saved = self.expert_forward(kind, activation, output_activation, gather_rows(self.ops, x, row_token),
                                       params, groups)
        return self.combine(y, weight_rows, row_pair, x.shape[0], top_k), saved

    def gathered_backward(self, kind, activation, output_activation, grad_out, weight_rows, x, row_token, saved,
                          params, groups):
        return self.expert_backward(kind, activation, output_activation, gather_rows(self.ops, grad_out, row_token),
                                    weight_rows, gather_rows(self.ops, x, row_token), saved, params, groups)

    def combine(self, expert_out, weight_rows, row_pair, num_tokens, top_k):
        return comb.combine(self.ops, expert_out, weight_rows, row_pair, num_tokens, top_k)

    def grad_gate_combine(self, grad_rows, out_rows, out_scale=None):
        return comb.grad_gate_combine(self.ops, grad_rows, out_rows, out_scale)

    def grad_input_combine(self, dx_rows, row_pair, num_tokens, top_k):
        return comb.grad_input_combine(self.ops, dx_rows, row_pair, num_tokens, top_k)


def select(config: MoEConfig, x: torch.Tensor, workspace: Workspace | None = None,
           expert_width: int | None = None) -> Backend:
    """The backend for one forward of a layer with `config` on input x [S, H]: Triton when
    kernels.fused_path(config, x, expert_width) (a CUDA tensor of a kernel dtype, or any under the
    test switch kernels.force_kernel_path(); triton importable; kernels not switched off in
    shardmoe.settings; experts at most kernels.KERNEL_MAX_FFN wide, `expert_width` being the width
    this rank computes); torch otherwise, on CPU with CpuOps.decide(x, workspace) (the C++ passes
    the forward may use, its row buffers from `workspace`: the pool exists for the CPU allocator's
    page faults, moe/cpu.py), elsewhere with TorchOps (on a GPU a GEMM into a given buffer would
    leave grouped_mm, which allocates its output, for a loop over experts). The kernels allocate
    their own. On CPU
    the kernels are not consulted unless that test switch is on (their interpreter is a test
    vehicle)."""
    on_cpu = x.device.type == "cpu"
    if (not on_cpu or kernels.FORCED) and kernels.fused_path(config, x, expert_width):
        from shardmoe.moe.triton_backend import TRITON  # imports triton: only when it runs

        return TRITON
    return TorchBackend(CpuOps.decide(x, workspace) if on_cpu else ex.TORCH_OPS)
