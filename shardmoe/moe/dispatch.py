"""The dispatcher seam: how the MoE Function's tokens reach the experts and come back.

The Function (moe/function.py) routes, hands x to its dispatcher, and the dispatcher runs
dispatch -> experts -> combine on a backend (moe/backends.py) and, in backward, the reverse:

  route     (router, x, router tensors) -> (routing, state)   the kept pairs sorted by expert
  forward   x [S, H] -> out [S, H] acc dtype, saved             dispatch, expert forward, combine
  backward  grad_out [S, H] -> (dx [S, H] acc dtype,            dispatch of g, stages 1-4,
            gate dots dw [N] token side, expert gradients)      combine of dx (stage 5)

Dispatchers:
  LocalDispatcher (here)   one process: every expert is local. Dispatch is the gather
                           x[row_token]; the backend's gathered entry points take x and grad_out
                           in token order with row_token, so a backend may fuse the gather (and
                           the forward combine) into its GEMMs.
  expert parallel          shardmoe/parallel/expert_parallel.py: the rows cross the 'e' axis in an
                           exchange, the experts' intermediate dim may be split over 't' (psums),
                           and the balance losses count the whole batch. The layer is handed it;
                           this package never imports shardmoe.parallel.

Where the routing comes from is the router's business (moe/routing.py: GateRouter, the layer's own
gate; GivenRouting, a routing handed in from outside, as transformers' experts seam does).
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from shardmoe.moe.backends import Backend
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.routing import Routing
from shardmoe.rows import Groups, accumulation_dtype


class Dispatcher(Protocol):
    """What the MoE Function asks of a dispatcher. `state` is whatever route() returned beside the
    routing (None for the local dispatcher); the Function keeps it on ctx for backward."""

    def guard(self) -> contextlib.AbstractContextManager:
        """Around a whole forward or backward (expert parallelism tells its peers on a failure)."""

    def timed(self, state, phase: str) -> contextlib.AbstractContextManager:
        """Around work the Function does itself, accounted to `phase` of the dispatcher's timing."""

    def prepare(self, config: MoEConfig, x: torch.Tensor, router_tensors: tuple, shared: dict) -> None:
        """Before the first route: checks that need the parameters (expert parallelism compares them
        across ranks)."""

    def route(self, router, x: torch.Tensor, router_tensors: tuple) -> tuple[Routing, object]:
        """The routing of x [S, H], capacity applied, and the dispatcher's state for this forward."""

    def forward(self, backend: Backend, config: MoEConfig, x: torch.Tensor, routing: Routing, state,
                params: dict) -> tuple[torch.Tensor, tuple]:
        """(out [S, H] in the acc dtype, tensors backward needs: "saved")."""

    def restore(self, config: MoEConfig, saved: tuple):
        """The state route() returned, rebuilt in backward from `saved` alone (the Function keeps
        only tensors, so that a compiled graph and saved-tensor hooks see everything)."""

    def backward(self, backend: Backend, config: MoEConfig, grad_out: torch.Tensor, x: torch.Tensor,
                 routing: Routing, state, saved: tuple, params: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
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
    """Every expert in this process: dispatch gathers x[row_token] (inside the backend's gathered
    entry points), combine sums w_r y_r into the token's row; stage 5 sums dx rows likewise."""

    def guard(self):
        return contextlib.nullcontext()

    def timed(self, state, phase):
        return contextlib.nullcontext()

    def prepare(self, config, x, router_tensors, shared):
        pass

    def route(self, router, x, router_tensors):
        return router.route(x, router_tensors, dropless=False), None

    def restore(self, config, saved):
        return None

    def forward(self, backend, config, x, routing, state, params):
        row_token, weight_rows = routing.rows(config.top_k)
        groups = Groups.from_counts(routing.kept_per_expert, row_token.shape[0])
        return backend.gathered_forward(config.kind, config.expert_activation, config.output_activation, x,
                                        row_token, weight_rows, routing.row_pair, config.top_k, params, groups)

    def backward(self, backend, config, grad_out, x, routing, state, saved, params):
        row_token, weight_rows = routing.rows(config.top_k)
        groups = Groups.from_counts(routing.kept_per_expert, row_token.shape[0])
        grad_xs, grad_dots, grads = backend.gathered_backward(
            config.kind, config.expert_activation, config.output_activation, grad_out, weight_rows, x, row_token,
            saved, params, groups)
        return backend.grad_input_combine(grad_xs, routing.row_pair, x.shape[0], config.top_k), grad_dots, grads

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
