"""The device choice and the dispatcher seam: on what the MoE operators' stages run, and how their
tokens reach the experts and come back.

select() makes the device choice, once per forward and again for its backward from the same config,
input and weights (the operators carry no Python object from one to the other), so the two agree
unless a setting changes in between; either way the results agree to round-off. It returns the ops
every stage of the step runs on:

  TorchOps   moe/experts.py: the stage math of moe/experts.py and moe/combine.py on torch's own
             row primitives (fresh buffers, so that its GEMMs are grouped_mm's): any device but
             the CPU
  CpuOps     moe/cpu.py: the same stage math on the CPU's primitives (the C++ passes and
             side-by-side GEMMs the forward allows, decided here once, and row buffers from the
             layer's workspace)
  TritonOps  moe/triton_ops.py: the routed experts' stages and the combine on the Triton kernels of
             shardmoe/kernels, for CUDA tensors of a kernel dtype and experts the kernels take
             (kernels.kernel_path); torch's primitives for the rest (the shared expert)

A new device is a subclass of TorchOps overriding what it runs its own way, and one condition in
select().

The dispatcher runs dispatch -> experts -> combine on those ops and, in backward, the reverse:

  route     (router, x, router tensors) -> (routing, state)   the kept pairs sorted by expert
  forward   x [S, H] -> out [S, H] acc dtype, saved             dispatch, expert forward, combine
  backward  grad_out [S, H] -> (dx [S, H] acc dtype,            dispatch of g, stages 1-4,
            gate dots dw [N] token side, expert gradients)      combine of dx (stage 5)

Dispatchers:
  LocalDispatcher (here)   one process: every expert is local. Dispatch is the gather
                           x[row_token]; the ops' expert entry points take x and grad_out in token
                           order with row_index = row_token, so the Triton kernels gather inside
                           their GEMMs.
  expert parallel          shardmoe/parallel/expert_parallel.py: the rows cross the 'e' axis in an
                           exchange, the experts' intermediate dim may be split over 't' (psums),
                           and the balance losses count the whole batch. The layer is handed it
                           (moe/placement.py); this package never imports shardmoe.parallel.

Where the routing comes from is the router's business (moe/routing.py: GateRouter, the layer's own
gate; GivenRouting, a routing handed in from outside, as transformers' experts seam does).
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from shardmoe import kernels
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.cpu import CpuOps, Workspace
from shardmoe.moe.experts import TORCH_OPS, TorchOps
from shardmoe.moe.routing import Routing
from shardmoe.rows import Groups, accumulation_dtype
from shardmoe.settings import SETTINGS


def select(config: MoEConfig, x: torch.Tensor, workspace: Workspace | None = None,
           expert_width: int | None = None) -> TorchOps:
    """The ops for one forward (or its backward) of a layer with `config` on input x [S, H]:
    TritonOps when kernels.kernel_path(config, x, expert_width) (a CUDA tensor of a kernel dtype, or
    any under the test switch shardmoe.settings force_kernels; triton importable; kernels not
    switched off in shardmoe.settings; experts at most kernels.KERNEL_MAX_FFN wide, `expert_width`
    being the width this rank computes); else on CPU CpuOps.decide(x, workspace) (the C++ passes
    the forward may use, its row buffers from `workspace`: the pool exists for the CPU allocator's
    page faults, moe/cpu.py), elsewhere TORCH_OPS (on a GPU a GEMM into a given buffer would leave
    grouped_mm, which allocates its output, for a loop over experts). The kernels allocate their
    own. A CPU step does not consult the kernels unless that test switch is on (their interpreter
    is a test vehicle)."""
    on_cpu = x.device.type == "cpu"
    if (not on_cpu or SETTINGS.force_kernels) and kernels.kernel_path(config, x, expert_width):
        from shardmoe.moe.triton_ops import TRITON_OPS  # imports triton: only when it runs

        return TRITON_OPS
    return CpuOps.decide(x, workspace) if on_cpu else TORCH_OPS


class Dispatcher(Protocol):
    """What the MoE operators ask of a dispatcher. `state` is whatever route() returned beside the
    routing (None for the local dispatcher); backward gets it back from restore(), which rebuilds
    it from the tensors forward() returned."""

    def guard(self) -> contextlib.AbstractContextManager:
        """Around a whole forward or backward (expert parallelism tells its peers on a failure)."""

    def timed(self, state, phase: str) -> contextlib.AbstractContextManager:
        """Around work the operators do themselves, accounted to `phase` of the dispatcher's timing."""

    def prepare(self, config: MoEConfig, x: torch.Tensor, router_tensors: tuple, shared: dict) -> None:
        """Before the first route: checks that need the parameters (expert parallelism compares them
        across ranks)."""

    def route(self, router, x: torch.Tensor, router_tensors: tuple) -> tuple[Routing, object]:
        """The routing of x [S, H], capacity applied, and the dispatcher's state for this forward."""

    def forward(self, ops: TorchOps, config: MoEConfig, x: torch.Tensor, routing: Routing, state,
                params: dict) -> tuple[torch.Tensor, tuple]:
        """(out [S, H] in the acc dtype, tensors backward needs: "dispatched")."""

    def restore(self, config: MoEConfig, dispatched: tuple):
        """The state route() returned, rebuilt in backward from `dispatched` alone (the operators keep
        only tensors, so that a compiled graph and saved-tensor hooks see everything)."""

    def backward(self, ops: TorchOps, config: MoEConfig, grad_out: torch.Tensor, x: torch.Tensor,
                 routing: Routing, state, dispatched: tuple, params: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(dx [S, H] acc dtype from stages 1-5, dw [N] of the pairs routing.row_pair lists, gradients)."""

    def fake_forward(self, config: MoEConfig, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, tuple]:
        """forward()'s outputs as uninitialised tensors of their shapes, for `routing`'s N rows
        (torch.compile's fake tensors)."""

    def loss_scope(self, routing: Routing, state) -> tuple[Routing, int | None, int | None]:
        """(routing with the selection counts the balance losses use, their S, their Q): None for
        this routing's own."""

    def stats(self, config: MoEConfig, routing: Routing, state, num_tokens: int) -> dict:
        """The forward's routing statistics for layer.stats."""

    def reduce_shared(self, what: str):
        """The reduction of the shared expert's partial sums: `what` is "output" [S, H], "input"
        [S, H] or "dot" [S] (identity unless its intermediate dim is split)."""


def expert_saved_like(config: MoEConfig, x: torch.Tensor, num_rows, width_split: int = 1) -> tuple:
    """Uninitialised tensors shaped as what the expert forward saves for num_rows rows of x's dtype,
    the intermediate dim split `width_split` ways: "glu" (h [N, 2F],), "mlp" (z1 [N, P], z2 [N, H])."""
    widths = config.kind.saved_widths(config.ffn_size // width_split, config.hidden_size)
    return tuple(x.new_empty(num_rows, width) for width in widths)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class LocalDispatcher:
    """Every expert in this process: dispatch gathers x[row_token] (inside the ops' expert entry
    points), combine sums w_r y_r into the token's row; stage 5 sums dx rows likewise."""

    def guard(self):
        return contextlib.nullcontext()

    def timed(self, state, phase):
        return contextlib.nullcontext()

    def prepare(self, config, x, router_tensors, shared):
        pass

    def route(self, router, x, router_tensors):
        return router.route(x, router_tensors, dropless=False), None

    def restore(self, config, dispatched):
        return None

    def forward(self, ops, config, x, routing, state, params):
        row_token, weight_rows = routing.rows(config.top_k)
        groups = Groups.from_counts(routing.kept_per_expert, row_token.shape[0])
        y, saved = ops.expert_forward(config.kind, config.expert_activation, config.output_activation, x, params,
                                      groups, row_index=row_token)
        return ops.combine(y, weight_rows, routing.row_pair, x.shape[0], config.top_k), saved

    def backward(self, ops, config, grad_out, x, routing, state, dispatched, params):
        row_token, weight_rows = routing.rows(config.top_k)
        groups = Groups.from_counts(routing.kept_per_expert, row_token.shape[0])
        grad_xs, grad_dots, grads = ops.expert_backward(
            config.kind, config.expert_activation, config.output_activation, grad_out, weight_rows, x, dispatched,
            params, groups, row_index=row_token)
        return ops.grad_input_combine(grad_xs, routing.row_pair, x.shape[0], config.top_k), grad_dots, grads

    def fake_forward(self, config, x, routing):
        return x.new_empty(x.shape, dtype=accumulation_dtype(x.dtype)), expert_saved_like(config, x, routing.row_pair.shape[0])

    def loss_scope(self, routing, state):
        return routing, None, None

    def stats(self, config, routing, state, num_tokens):
        return dict(tokens_per_expert=routing.kept_per_expert, selected_per_expert=routing.selected_per_expert,
                    rank_selected_per_expert=routing.selected_per_expert, dropped_tokens=routing.dropped_pairs,
                    capacity=config.capacity(num_tokens))

    def reduce_shared(self, what):
        return _identity


LOCAL = LocalDispatcher()
