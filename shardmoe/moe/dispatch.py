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
                    dropped_tokens=routing.dropped_pairs, capacity=config.capacity(num_tokens))

    def reduce_shared(self, what):
        return _identity


LOCAL = LocalDispatcher()


class Placement(Protocol):
    """Where a layer's parameters and tokens live: its dispatcher, and the shards of its expert
    parameters on this rank (name: a parameter of the layer; shape: its whole shape)."""

    dispatcher: Dispatcher
    sharded: bool

    def shard_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def layout(self, name: str) -> tuple | None:
        """(DeviceMesh, placements) of parameter `name` when the mesh splits parameters, else None."""

    def parameter(self, name: str, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The data of parameter `name` whose shard on this rank is `local` and whole shape `shape`: a
        DTensor of the whole (sharing local's storage) when the mesh splits parameters, else local."""

    def compute_view(self, name: str, param: torch.Tensor, summed_over_e: bool) -> torch.Tensor:
        """The tensor the forward computes on: a DTensor parameter's local tensor, differentiable, its
        gradient a DTensor of the placements the backward leaves (`summed_over_e`: the backward
        sums the replicated gradients over 'e' itself); a plain parameter as it is."""

    def shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole parameter (no communication)."""

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole parameter from every rank's shard (collective when sharded)."""

    def state_entry(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The layer's state-dict entry of a routed or shared expert parameter from this rank's shard:
        the whole tensor in its state-dict layout (packed), a DTensor when the mesh shards it, sharing
        the shard's storage (distributed checkpoints load into it in place)."""

    def load_entry(self, key: str, name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's shard, in the parameter's shape, of a state-dict entry `key` (state_entry's
        form, or whole_entry's); ValueError naming the key and the shapes for any other."""


# The state dict holds gate_up_proj [E, 2F, H] as its [E, 2, F, H] view (and its bias, and the shared
# expert's, likewise): 't' splits F, so a rank holds a slice of the gate rows and the same slice of the
# up rows, which is one block of the view but two of [E, 2F, H], and a distributed checkpoint's
# DTensor describes one block per rank.
PACKED = ("gate_up_proj", "gate_up_proj_bias", "shared_gate_up_proj")


def packed(name: str, t: torch.Tensor) -> torch.Tensor:
    """gate_up_proj [E, 2F, H] -> its [E, 2, F, H] view, shared_gate_up_proj [2Fs, H] -> [2, Fs, H],
    gate_up_proj_bias [E, 2F] -> [E, 2, F] (the gate rows, then the up rows); others as they are."""
    if name not in PACKED:
        return t
    dim = t.dim() - 2 if name.endswith("proj") else t.dim() - 1  # the 2F dim
    return t.unflatten(dim, (2, t.shape[dim] // 2))


def unpacked(name: str, t: torch.Tensor) -> torch.Tensor:
    """Inverse of packed (a copy if t is a strided shard)."""
    if name not in PACKED:
        return t
    dim = t.dim() - 3 if name.endswith("proj") else t.dim() - 2
    return t.flatten(dim, dim + 1)


def whole_entry(key: str, name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole parameter `name` (its own layout, `shape`) from a state-dict entry holding the whole
    tensor: plain, in the state-dict layout (packed) or the parameter's own (an unsharded state dict
    saved with torch.save), or a DTensor of either, gathered whole (a collective over its mesh).
    ValueError naming the key, the shapes it may have, and the shape it has."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            value = value.full_tensor()
    state_shape = tuple(packed(name, torch.empty(shape, device="meta")).shape)
    if tuple(value.shape) == state_shape:
        return unpacked(name, value)
    if tuple(value.shape) == tuple(shape):
        return value
    also = "" if state_shape == tuple(shape) else f" (or the parameter's layout {list(shape)})"
    raise ValueError(f"state_dict[{key!r}]: expected the whole tensor, of shape {list(state_shape)}{also}, "
                     f"as a tensor or a DTensor, got shape {list(value.shape)}")


class LocalPlacement:
    """One process: every parameter whole, the local dispatcher."""

    dispatcher, sharded = LOCAL, False

    def shard_shape(self, name, shape):
        return tuple(shape)

    def layout(self, name):
        return None

    def parameter(self, name, local, shape):
        return local

    def compute_view(self, name, param, summed_over_e):
        return param

    def shard(self, name, whole):
        return whole

    def gather(self, name, local):
        return local

    def state_entry(self, name, local):
        return packed(name, local)

    def load_entry(self, key, name, value, shape):
        return whole_entry(key, name, value, shape)


_mesh_placement = None  # (config, mesh) -> Placement: shardmoe.parallel registers it on import


def register_mesh_placement(factory) -> None:
    """Set what placement(config, mesh) builds for a mesh: expert parallelism's (shardmoe.parallel
    calls this when imported, which `import shardmoe` does), so this package imports none of it."""
    global _mesh_placement
    _mesh_placement = factory


def placement(config: MoEConfig, mesh) -> Placement:
    """The placement of a layer with `config` on `mesh` (None: one process)."""
    if mesh is None:
        return LocalPlacement()
    if _mesh_placement is None:
        raise RuntimeError("mesh: a layer on a mesh needs shardmoe.parallel, which registers expert parallelism "
                           "(`import shardmoe` imports it)")
    return _mesh_placement(config, mesh)
