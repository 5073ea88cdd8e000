"""The MoE computation, forward and explicit backward, behind every way into shardmoe's MoE.

moe/ops.py registers it as the torch operators shardmoe::moe_forward / moe_backward with their
autograd (ops.FusedMoE): the one autograd node of an MoE layer. This module holds what they run.
Every way in runs through it: the MoE module on one process, the same module with expert
parallelism, and transformers' experts seam (shardmoe.hf). What differs between them
is handed in (MoEContext): where the routing comes from (the router: moe/routing.py GateRouter or
GivenRouting) and how the rows reach the experts and come back (the dispatcher: moe/dispatch.py's
LocalDispatcher, or expert parallelism's, shardmoe/parallel/expert_parallel.py).

Forward (S tokens, H hidden, E experts, k top-k, N kept pairs, sorted by expert):
  routing = dispatcher.route(router, x)          weights w [S, k], row_pair [N]
  out     = dispatcher.forward(backend, x)       dispatch x rows -> y = experts(xs) [N, H]
                                                 -> combine out_t = sum_j w_tj y_j(x_t)   [S, H]
  out_t  += s_t shared(x_t)                      (shared_ffn_size > 0: moe/shared_experts.py)
  loss    = router.loss(routing)                 aux + z + sequence-wise, scalar; its gradient is
                                                 the incoming one plus call.loss_scale

Backward, in the six stages of the FlashMoE task design (docs/architecture.md):
  1 grad_combine  2 grad_gate_combine  3 grad_post_gemm  4 grad_pre_gemm   (backend, on rows)
  5 grad_input_combine                                                      (dispatcher)
  6 grad_gate_gemm                                                          (router)
The shared expert's own stages 3, 2, 4 and its gate's gradient run after 5 and add into dx.

Saved for backward (all through ctx.save_for_backward, so saved-tensor hooks see them): x [S, H],
the inputs (router tensors and weights; the tensors among them are not copies), and SavedForBackward: the routing
(routing.Routing: probs [S, E], logsumexp [S], top_idx [S, k] int64, top_prob [S, k], weight
[S, k] acc dtype, counts [E] x2, row_pair [N] int64, and the router options' extras; the
sequence-wise loss's per-sequence counts are recounted in backward), the shared
expert's h_shared [S, 2Fs] and s [S], what the dispatcher keeps (expert parallelism: the counts
table, the received rows and their order) and the expert's "glu": h [N, 2F]; "mlp": z1 [N, P], z2 [N, H]. The expert
output y is not saved: "glu" takes the gate dot as (g Wdown) . a, "mlp" recomputes act_out(z2).
Per token that is H + k*2F (glu) elements of the input dtype plus the routing state: docs/moe.md.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from shardmoe.moe import backends
from shardmoe.moe import shared_experts as shared_ex
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.routing import Routing, sequence_selections
from shardmoe.moe.cpu import Workspace
from shardmoe.rows import accumulation_dtype


class _SecondDerivative(torch.autograd.Function):
    """Identity on a first backward's gradients, whose own backward (the second derivative) raises."""

    @staticmethod
    def forward(ctx, where: str, *grads):
        ctx.where = where
        return grads

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.where}: the fused MoE backward is not twice differentiable: its explicit backward is "
            "not built from autograd ops, so a double backward through shardmoe.MoE (a gradient penalty, "
            "torch.autograd.grad(..., create_graph=True) then backward) has no correct result")


def not_twice_differentiable(backward):
    """Decorator for an explicit autograd.Function backward that has no second derivative.

    Like torch.autograd.function.once_differentiable, the backward runs without recording a graph
    and, under create_graph=True, its gradients come out of a node that raises when differentiated.
    Unlike it, the node is attached whenever the Function had an input needing a gradient, not only
    when the incoming gradients require grad: the first-order gradients depend on the saved inputs
    and weights, so a penalty on them would otherwise get a silently wrong (zero) second derivative."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        # the gradients and needs_input_grad may nest lists (an operator's list arguments)
        if not torch.is_grad_enabled() or not any(pytree.tree_leaves(ctx.needs_input_grad)):
            return grads
        leaves, spec = pytree.tree_flatten(grads)
        tensors = [i for i, g in enumerate(leaves) if isinstance(g, torch.Tensor)]
        # detached leaves that require grad, so the raising node gets an edge to hang on
        wrapped = _SecondDerivative.apply(backward.__qualname__,
                                          *(leaves[i].detach().requires_grad_() for i in tensors))
        for i, g in zip(tensors, wrapped):
            leaves[i] = g
        return pytree.tree_unflatten(leaves, spec)

    return wrapper


@dataclass(frozen=True)
class BalanceScope:
    """The batch the balance losses average over when a forward sees only part of it (a micro-batch
    of gradient accumulation): selected [E] top-k choices per expert over the whole batch, its
    tokens S and sequences Q. Each part's loss is then its share (routing.balance_loss with these
    S, Q and counts), and the parts' shares sum to the whole batch's loss. Every forward's
    stats["balance_scope"] is its own scope (global over the mesh), to be summed over the parts."""

    selected: torch.Tensor
    num_tokens: int
    num_sequences: int


@dataclass
class MoEContext:
    """The non-tensor arguments of one MoE forward (and its backward).

    config: the layer's MoEConfig; router: GateRouter or GivenRouting (moe/routing.py); dispatcher:
    moe/dispatch.py's protocol; workspace: the pool of large row buffers (None: fresh ones);
    stats: called with each forward's routing statistics, a new dict (None: not kept);
    loss_scale: dL/d(loss) that backward adds to the loss's own incoming gradient, so the balance
    losses reach the router through the output's graph, at the first backward through a forward
    only (SavedForBackward.balance_pending; None or 0: only the incoming one);
    balance_scope: the whole batch the balance losses average over, when it is more than this
    forward's tokens (None: this forward's, global over the mesh);
    reduce_grads: applied in place to the parameter gradients before backward returns them, as
    reduce_grads(replicated, experts): the router's and the shared expert's, then the routed
    experts' (None: left to the caller, sync_grads)."""

    config: MoEConfig
    router: object
    dispatcher: object
    workspace: Workspace | None = None
    stats: Callable[[dict], None] | None = None
    loss_scale: float | None = None
    balance_scope: BalanceScope | None = None
    reduce_grads: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None



@dataclass
class SavedForBackward:
    """The tensors a forward makes that its backward reads (beside the inputs, which are saved as
    they are): the routing, the shared expert's (h_shared, s), what the dispatcher kept, and
    balance_pending [] (acc dtype), 1 until a backward has applied the call's loss_scale, then 0:
    the balance losses' gradient rides on the output's backward once per forward, however many
    backwards run through it (retain_graph: chunked losses, autograd.grad per task).

    Not among them: the routing fields that are router inputs themselves (router.routing_inputs:
    a given routing's top_k_index and top_k_weights, the layer's token_sequence), which are saved
    as inputs; and the sequence-wise loss's per-sequence counts, which backward recounts from the
    saved choices and sequence ids (two bincounts over S k), so that no saved tensor has a size
    that depends on the data beyond the kept pairs N."""

    routing: Routing
    shared: tuple
    dispatched: tuple
    balance_pending: torch.Tensor

    def flat(self, inputs: dict) -> tuple:
        """The tensors to save, less the routing fields in `inputs` (router.routing_inputs)."""
        kept = [getattr(self.routing, n) for n in _saved_fields(inputs)]
        return (self.balance_pending, *kept, *self.shared, *self.dispatched)

    @classmethod
    def restore(cls, config: MoEConfig, tensors, inputs: dict) -> "SavedForBackward":
        """The record flat(inputs) came from, with the fields in `inputs` taken from there."""
        balance_pending, *tensors = tensors
        names = _saved_fields(inputs)
        routing = dict(zip(names, tensors), **inputs)
        if config.seq_aux_loss_coef:
            routing["sequence_selected"], routing["sequence_tokens"] = sequence_selections(
                routing["top_idx"], routing["token_sequence"], config.num_experts)
        else:
            device = routing["top_idx"].device
            routing["sequence_selected"] = torch.zeros(0, config.num_experts, dtype=torch.int64, device=device)
            routing["sequence_tokens"] = torch.zeros(0, dtype=torch.int64, device=device)
        rest = tensors[len(names):]
        n_shared = 2 if config.shared_ffn_size else 0
        return cls(Routing(**routing), tuple(rest[:n_shared]), tuple(rest[n_shared:]), balance_pending)


_RECOUNTED = ("sequence_selected", "sequence_tokens")


def _saved_fields(inputs: dict) -> list[str]:
    return [f.name for f in fields(Routing) if f.name not in _RECOUNTED and f.name not in inputs]


def split_inputs(call: MoEContext, tensors) -> tuple[tuple, dict, dict]:
    """(router tensors, {expert param name: tensor}, {shared param name: tensor}) of the tensors
    after x: router.num_tensors router tensors, the expert params in expert_param_names order, then
    the shared expert's in shared_param_names order."""
    config, n_router = call.config, call.router.num_tensors
    expert_weights, shared_weights = split_weights(config, tensors[n_router:])
    return (tuple(tensors[:n_router]), dict(zip(config.expert_param_names, expert_weights)),
            dict(zip(config.shared_param_names, shared_weights)))


def local_width(config, params: dict) -> int:
    """The intermediate width F (P) this rank's expert GEMMs have: the down projection's last dim,
    F/t under expert tensor parallelism."""
    return params[config.kind.down].shape[-1]


def moe_forward(call: MoEContext, x: torch.Tensor, tensors) -> tuple[torch.Tensor, torch.Tensor, SavedForBackward]:
    """x [S, H], the router tensors and weights -> (out [S, H] in x's dtype, loss [] acc dtype, SavedForBackward).
    The stages run on the backend backends.select() picks; the backward picks the same."""
    config, router, dispatcher = call.config, call.router, call.dispatcher
    router_tensors, params, shared = split_inputs(call, tensors)
    with dispatcher.guard():
        dispatcher.prepare(config, x, router_tensors, shared)
        backend = backends.select(config, x, call.workspace, local_width(config, params))
        routing, state = dispatcher.route(router, x, router_tensors)
        out, dispatched = dispatcher.forward(backend, config, x, routing, state, params)
        shared_saved = ()
        with dispatcher.timed(state, "experts"):
            if shared:
                shared_out, shared_saved = shared_ex.forward(backend.ops, x, shared, config,
                                                             dispatcher.reduce_shared("output"))
                out = out + shared_out  # both in the acc dtype: one rounding below
            out = out.to(x.dtype)
        with dispatcher.timed(state, "combine"):
            scope = dispatcher.loss_scope(routing, state)
            own = BalanceScope(scope[0].selected_per_expert, x.shape[0] if scope[1] is None else scope[1],
                               routing.sequence_tokens.numel() if scope[2] is None else scope[2])
            loss_routing, num_tokens, num_sequences = _with_balance_scope(call, *scope)
            loss = router.loss(loss_routing, num_tokens, num_sequences)
            if call.stats is not None:
                stats = dispatcher.stats(config, routing, state, x.shape[0])
                stats["workspace_bytes"] = 0 if call.workspace is None else call.workspace.resident_bytes
                stats["balance_scope"] = own
                call.stats(stats)
    pending = x.new_ones((), dtype=accumulation_dtype(x.dtype))
    return out, loss, SavedForBackward(loss_routing, tuple(shared_saved), tuple(dispatched), pending)


def moe_fake_forward(call: MoEContext, x: torch.Tensor, tensors, dynamic) -> tuple[torch.Tensor, torch.Tensor, SavedForBackward]:
    """moe_forward's outputs as uninitialised tensors of their shapes and dtypes, computing nothing
    (torch.compile traces with these). N, the kept pairs, is S k without capacity drops and a
    data-dependent size (`dynamic()`) with them."""
    config = call.config
    router_tensors, _, shared = split_inputs(call, tensors)
    S, acc = x.shape[0], accumulation_dtype(x.dtype)
    num_rows = dynamic() if config.can_drop else S * config.top_k
    routing = call.router.fake_routing(x, router_tensors, num_rows)
    _, dispatched = call.dispatcher.fake_forward(config, x, routing)
    shared_saved = ()
    if shared:
        shared_saved = (x.new_empty(S, shared["shared_down_proj"].shape[1] * 2), x.new_empty(S, dtype=acc))
    return (x.new_empty(x.shape), x.new_empty((), dtype=acc),
            SavedForBackward(routing, shared_saved, tuple(dispatched), x.new_empty((), dtype=acc)))


def moe_backward(call: MoEContext, x: torch.Tensor, tensors, made: SavedForBackward, grad_out: torch.Tensor,
                 grad_loss: torch.Tensor) -> tuple:
    """The six stages: (dx, then a gradient or None for each of `tensors`, in their order)."""
    config, router, dispatcher = call.config, call.router, call.dispatcher
    router_tensors, params, shared = split_inputs(call, tensors)
    routing = made.routing
    backend = backends.select(config, x, call.workspace, local_width(config, params))
    grad_out = grad_out.contiguous()
    if call.loss_scale:
        grad_loss = grad_loss + call.loss_scale * made.balance_pending
        # applied: a later backward through the same forward adds none. The flag is a saved tensor
        # of this forward; autograd's version check would refuse that later backward for a write it
        # counted, and none of its gradients read the flag's old value.
        with torch.autograd._unsafe_preserve_version_counter(made.balance_pending):
            made.balance_pending.zero_()
    with dispatcher.guard():
        state = dispatcher.restore(config, made.dispatched)
        # stages 1-5
        grad_x, grad_dots, grads = dispatcher.backward(backend, config, grad_out, x, routing, state,
                                                       made.dispatched, params)
        with dispatcher.timed(state, "route"):  # stage 6, from dL/dw [S, k] (zero for dropped pairs)
            # the saved routing is the loss's: it already holds the balance scope's counts
            _, num_tokens, num_sequences = _with_balance_scope(call, *dispatcher.loss_scope(routing, state))
            S, k = x.shape[0], config.top_k
            grad_weight = x.new_zeros(S * k, dtype=accumulation_dtype(x.dtype))
            grad_weight[routing.row_pair] = grad_dots
            grad_x_router, router_grads = router.backward(x, router_tensors, routing, grad_weight.view(S, k),
                                                          grad_loss, num_tokens, num_sequences)
            if grad_x_router is not None:
                grad_x = grad_x + grad_x_router
        shared_grads = []
        with dispatcher.timed(state, "experts"):
            if shared:
                grad_x_shared, named = shared_ex.backward(backend.ops, grad_out, x, made.shared, shared, config,
                                                          dispatcher.reduce_shared("input"),
                                                          dispatcher.reduce_shared("dot"))
                grad_x = grad_x + grad_x_shared
                shared_grads = [named[n] for n in shared]
    expert_grads = [None if p is None else grads[n].to(p.dtype) for n, p in params.items()]
    if call.reduce_grads is not None:
        call.reduce_grads([g for g in (*router_grads, *shared_grads) if g is not None],
                          [g for g in expert_grads if g is not None])
    return (grad_x.to(x.dtype), *router_grads, *expert_grads, *shared_grads)


def _with_balance_scope(call: MoEContext, routing: Routing, num_tokens: int | None, num_sequences: int | None) -> tuple:
    """dispatcher.loss_scope's (routing, S, Q), with the call's balance scope in their place when it
    has one: its selection counts, tokens and sequences."""
    scope = call.balance_scope
    if scope is None:
        return routing, num_tokens, num_sequences
    return (dataclasses.replace(routing, selected_per_expert=scope.selected), scope.num_tokens,
            scope.num_sequences)


def split_weights(config: MoEConfig, weights) -> tuple[tuple, tuple]:
    """(routed expert weights, shared expert weights) of the weights after the router tensors."""
    n_expert = len(config.expert_param_names)
    return tuple(weights[:n_expert]), tuple(weights[n_expert:])
