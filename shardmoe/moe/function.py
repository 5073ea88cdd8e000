"""The MoE computation, forward and explicit backward, as the torch operators every way into
shardmoe's MoE runs through, with their registered autograd: the one autograd node of an MoE layer.

  shardmoe::moe_forward(handle, x, present, absent) -> (out [..., H], loss [], saved)
  shardmoe::moe_backward(handle, grad_out, grad_loss, x, present, absent, saved, wanted)
      -> [dx, the gradient of each present input that `wanted` marks]

moe_forward and moe_backward below are the operators' bodies. x [..., H] is any number of tokens S
in any leading shape (the operators flatten it to [S, H]); out has x's shape without being a view
of anything the caller holds. Both run with autocast off: the caller casts what should run in
autocast's dtype (moe/precision.py), and the router inside must stay in its float32 accumulation
dtype.

The inputs are the router tensors and weights after x: for the layer gate_weight, gate_bias,
correction_bias, token_sequence, then the expert and shared-expert params; for transformers' seam
top_k_index, top_k_weights, then the expert params; some of them None. The operators take the
present ones and a mask of the absent (operator_inputs: a list of optional tensors cannot carry
gradients through torch.library's autograd). `saved` are the tensors the forward makes for its
backward (SavedForBackward). Every tensor the backward reads is an input or an output, saved by the
registered autograd through ctx.save_for_backward: saved-tensor hooks and activation checkpointing
see all of it, and a compiled graph holds it like any other activation. `wanted` marks the present
inputs autograd asks a gradient of (ctx.needs_input_grad).

Everything else a forward needs (MoEContext: config, router, dispatcher, workspace, stats) is the
owner's: an object with moe_context(x, inputs) -> MoEContext (shardmoe.MoE; the transformers seam's
SeamOwner), registered once for an int handle that the graph carries as a constant, held weakly (a
handle dies with its layer), and looked up once per forward and once per backward. What differs
between the ways in is in it: where the routing comes from (the router: moe/routing.py GateRouter
or GivenRouting) and how the rows reach the experts and come back (the dispatcher: moe/dispatch.py's
LocalDispatcher, or expert parallelism's, shardmoe/parallel/expert_parallel.py).

Forward (S tokens, H hidden, E experts, k top-k, N kept pairs, sorted by expert):
  ops     = dispatch.select(config, x)           the device's stage implementations (moe/experts.py
                                                 TorchOps, moe/cpu.py CpuOps, moe/triton_ops.py)
  routing = dispatcher.route(router, x)          weights w [S, k], row_pair [N]
  out     = dispatcher.forward(ops, x)           dispatch x rows -> y = experts(xs) [N, H]
                                                 -> combine out_t = sum_j w_tj y_j(x_t)   [S, H]
  out_t  += s_t shared(x_t)                      (shared_ffn_size > 0: moe/shared_experts.py)
  loss    = router.loss(routing)                 aux + z + sequence-wise, scalar; its gradient is
                                                 the incoming one plus context.loss_scale

Backward, in the six stages of the FlashMoE task design (docs/architecture.md):
  1 grad_combine  2 grad_gate_combine  3 grad_post_gemm  4 grad_pre_gemm   (ops, on rows)
  5 grad_input_combine                                                      (dispatcher)
  6 grad_gate_gemm                                                          (router)
The shared expert's own stages 3, 2, 4 and its gate's gradient run after 5 and add into dx.

Saved for backward: x [S, H], the inputs (router tensors and weights; the tensors among them are
not copies), and SavedForBackward: the routing (routing.Routing: probs [S, E], logsumexp [S],
top_idx [S, k] int64, top_prob [S, k], weight [S, k] acc dtype, counts [E] x2, row_pair [N] int64,
and the router options' extras; the sequence-wise loss's per-sequence counts are recounted in
backward), the shared expert's h_shared [S, 2Fs] and s [S], what the dispatcher keeps (expert
parallelism: the counts table, the received rows and their order) and the expert's "glu":
h [N, 2F]; "mlp": z1 [N, P], z2 [N, H]. The expert output y is not saved: "glu" takes the gate dot
as (g Wdown) . a, "mlp" recomputes act_out(z2). Per token that is H + k*2F (glu) elements of the
input dtype plus the routing state: docs/moe.md.

The fake implementations give every output's shape and dtype without computing: N, the kept pairs,
is S k when no capacity can drop a pair and a data-dependent size otherwise (moe_fake_forward).
Under compile, routing, dispatch and the stages run inside the operator, as in eager; inductor
fuses around it.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from shardmoe.moe import dispatch, precision
from shardmoe.moe import shared_experts as shared_ex
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.cpu import Workspace
from shardmoe.moe.routing import Routing, sequence_selections
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
            f"{ctx.where}: the MoE backward is not twice differentiable: its explicit backward is "
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


# -- owners: what names a forward's MoEContext --------------------------------------------------

_OWNERS: dict[int, weakref.ref] = {}
_HANDLES = itertools.count(1)


def register(owner) -> int:
    """A new handle for `owner` (anything with moe_context(x, inputs) -> MoEContext), held weakly."""
    handle = next(_HANDLES)
    _OWNERS[handle] = weakref.ref(owner, lambda _, handle=handle: _OWNERS.pop(handle, None))
    return handle


def _context(handle: int, x: torch.Tensor, inputs: tuple) -> MoEContext:
    """The MoEContext the owner of `handle` gives for x [S, H] and the inputs."""
    ref = _OWNERS.get(handle)
    owner = None if ref is None else ref()
    if owner is None:
        raise RuntimeError(f"shardmoe::moe_forward: handle {handle} names no live MoE layer (it was freed, or the "
                           "handle was not made by shardmoe.moe.function.register in this process)")
    return owner.moe_context(x, inputs)


def operator_inputs(inputs) -> tuple[list[torch.Tensor], list[bool]]:
    """(present, absent) for the operators, from the inputs after x with None where absent."""
    return [t for t in inputs if t is not None], [t is None for t in inputs]


def _inputs(present, absent) -> tuple:
    """The inputs, None where absent, from the present tensors and the mask."""
    it = iter(present)
    return tuple(None if a else next(it) for a in absent)


def split_inputs(context: MoEContext, tensors) -> tuple[tuple, dict, dict]:
    """(router tensors, {expert param name: tensor}, {shared param name: tensor}) of the tensors
    after x: router.num_tensors router tensors, the expert params in expert_param_names order, then
    the shared expert's in shared_param_names order."""
    config, n_router = context.config, context.router.num_tensors
    expert_weights, shared_weights = split_weights(config, tensors[n_router:])
    return (tuple(tensors[:n_router]), dict(zip(config.expert_param_names, expert_weights)),
            dict(zip(config.shared_param_names, shared_weights)))


def split_weights(config: MoEConfig, weights) -> tuple[tuple, tuple]:
    """(routed expert weights, shared expert weights) of the weights after the router tensors."""
    n_expert = len(config.expert_param_names)
    return tuple(weights[:n_expert]), tuple(weights[n_expert:])


def local_width(config, params: dict) -> int:
    """The intermediate width F (P) this rank's expert GEMMs have: the down projection's last dim,
    F/t under expert tensor parallelism."""
    return params[config.kind.down].shape[-1]


def _routing_inputs(context: MoEContext, inputs) -> dict:
    """The routing fields that are inputs: saved as inputs, not again among the saved outputs."""
    return context.router.routing_inputs(tuple(inputs[:context.router.num_tensors]))


# -- the operators --------------------------------------------------------------------------------


def moe_forward(handle: int, x: torch.Tensor, present: list[torch.Tensor],
                absent: list[bool]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """shardmoe::moe_forward: (out [..., H] in x's dtype, loss [] acc dtype, the saved tensors) of the
    owner of `handle` on x [..., H] and the inputs."""
    inputs = _inputs(present, absent)
    tokens = x.reshape(-1, x.shape[-1])
    context = _context(handle, tokens, inputs)
    config, router, dispatcher = context.config, context.router, context.dispatcher
    router_tensors, params, shared = split_inputs(context, inputs)
    with precision.autocast_off(x.device.type), dispatcher.guard():
        dispatcher.prepare(config, tokens, router_tensors, shared)
        ops = dispatch.select(config, tokens, context.workspace, local_width(config, params))
        routing, state = dispatcher.route(router, tokens, router_tensors)
        out, dispatched = dispatcher.forward(ops, config, tokens, routing, state, params)
        shared_saved = ()
        with dispatcher.timed(state, "experts"):
            if shared:
                shared_out, shared_saved = shared_ex.forward(ops, tokens, shared, config,
                                                             dispatcher.reduce_shared("output"))
                out = out + shared_out  # both in the acc dtype: one rounding below
            out = out.to(x.dtype)
        with dispatcher.timed(state, "combine"):
            scope = dispatcher.loss_scope(routing, state)
            own = BalanceScope(scope[0].selected_per_expert, tokens.shape[0] if scope[1] is None else scope[1],
                               routing.sequence_tokens.numel() if scope[2] is None else scope[2])
            loss_routing, num_tokens, num_sequences = _with_balance_scope(context, *scope)
            loss = router.loss(loss_routing, num_tokens, num_sequences)
            if context.stats is not None:
                stats = dispatcher.stats(config, routing, state, tokens.shape[0])
                stats["workspace_bytes"] = 0 if context.workspace is None else context.workspace.resident_bytes
                stats["balance_scope"] = own
                context.stats(stats)
    pending = x.new_ones((), dtype=accumulation_dtype(x.dtype))
    saved = SavedForBackward(loss_routing, tuple(shared_saved), tuple(dispatched), pending)
    return _shaped(out, x.shape), loss, _fresh(saved.flat(_routing_inputs(context, inputs)), (x, *present))


def moe_fake_forward(handle, x, present, absent):
    """moe_forward's outputs as uninitialised tensors of their shapes and dtypes, computing nothing
    (torch.compile traces with these). N, the kept pairs, is S k without capacity drops and a
    data-dependent size with them."""
    inputs = _inputs(present, absent)
    tokens = x.reshape(-1, x.shape[-1])
    context = _context(handle, tokens, inputs)
    config = context.config
    router_tensors, _, shared = split_inputs(context, inputs)
    S, acc = tokens.shape[0], accumulation_dtype(x.dtype)
    num_rows = torch.library.get_ctx().new_dynamic_size() if config.can_drop else S * config.top_k
    routing = context.router.fake_routing(tokens, router_tensors, num_rows)
    _, dispatched = context.dispatcher.fake_forward(config, tokens, routing)
    shared_saved = ()
    if shared:
        shared_saved = (x.new_empty(S, shared["shared_down_proj"].shape[1] * 2), x.new_empty(S, dtype=acc))
    saved = SavedForBackward(routing, shared_saved, tuple(dispatched), x.new_empty((), dtype=acc))
    return x.new_empty(x.shape), x.new_empty((), dtype=acc), list(saved.flat(_routing_inputs(context, inputs)))


def moe_backward(handle: int, grad_out: torch.Tensor, grad_loss: torch.Tensor, x: torch.Tensor,
                 present: list[torch.Tensor], absent: list[bool], saved: list[torch.Tensor],
                 wanted: list[bool]) -> list[torch.Tensor]:
    """shardmoe::moe_backward, the six stages: [dx [..., H], then for each present input that `wanted`
    marks its gradient (zeros for one that has none: an index, a correction bias)]."""
    inputs = _inputs(present, absent)
    tokens = x.reshape(-1, x.shape[-1])
    context = _context(handle, tokens, inputs)
    config, router, dispatcher = context.config, context.router, context.dispatcher
    router_tensors, params, shared = split_inputs(context, inputs)
    record = SavedForBackward.restore(config, saved, _routing_inputs(context, inputs))
    routing = record.routing
    with precision.autocast_off(x.device.type):
        ops = dispatch.select(config, tokens, context.workspace, local_width(config, params))
        grad_out = grad_out.reshape(tokens.shape).contiguous()
        if context.loss_scale:
            grad_loss = grad_loss + context.loss_scale * record.balance_pending
            # applied: a later backward through the same forward adds none. The flag is a saved tensor
            # of this forward; autograd's version check would refuse that later backward for a write it
            # counted, and none of its gradients read the flag's old value.
            with torch.autograd._unsafe_preserve_version_counter(record.balance_pending):
                record.balance_pending.zero_()
        with dispatcher.guard():
            state = dispatcher.restore(config, record.dispatched)
            # stages 1-5
            grad_x, grad_dots, grads = dispatcher.backward(ops, config, grad_out, tokens, routing, state,
                                                           record.dispatched, params)
            with dispatcher.timed(state, "route"):  # stage 6, from dL/dw [S, k] (zero for dropped pairs)
                # the saved routing is the loss's: it already holds the balance scope's counts
                _, num_tokens, num_sequences = _with_balance_scope(context, *dispatcher.loss_scope(routing, state))
                S, k = tokens.shape[0], config.top_k
                grad_weight = tokens.new_zeros(S * k, dtype=accumulation_dtype(x.dtype))
                grad_weight[routing.row_pair] = grad_dots
                grad_x_router, router_grads = router.backward(tokens, router_tensors, routing,
                                                              grad_weight.view(S, k), grad_loss, num_tokens,
                                                              num_sequences)
                if grad_x_router is not None:
                    grad_x = grad_x + grad_x_router
            shared_grads = []
            with dispatcher.timed(state, "experts"):
                if shared:
                    grad_x_shared, named = shared_ex.backward(ops, grad_out, tokens, record.shared, shared, config,
                                                              dispatcher.reduce_shared("input"),
                                                              dispatcher.reduce_shared("dot"))
                    grad_x = grad_x + grad_x_shared
                    shared_grads = [named[n] for n in shared]
        expert_grads = [None if p is None else grads[n].to(p.dtype) for n, p in params.items()]
        if context.reduce_grads is not None:
            context.reduce_grads([g for g in (*router_grads, *shared_grads) if g is not None],
                                 [g for g in expert_grads if g is not None])
    input_grads = (*router_grads, *expert_grads, *shared_grads)
    present_grads = [(t, g) for t, g in zip(inputs, input_grads) if t is not None]
    return [grad_x.to(x.dtype).reshape(x.shape).contiguous(),
            *(torch.zeros_like(t) if g is None else g.contiguous()
              for (t, g), want in zip(present_grads, wanted) if want)]


def moe_fake_backward(handle, grad_out, grad_loss, x, present, absent, saved, wanted):
    return [x.new_empty(x.shape), *(t.new_empty(t.shape) for t, want in zip(present, wanted) if want)]


def _with_balance_scope(context: MoEContext, routing: Routing, num_tokens: int | None,
                        num_sequences: int | None) -> tuple:
    """dispatcher.loss_scope's (routing, S, Q), with the context's balance scope in their place when it
    has one: its selection counts, tokens and sequences."""
    scope = context.balance_scope
    if scope is None:
        return routing, num_tokens, num_sequences
    return (dataclasses.replace(routing, selected_per_expert=scope.selected), scope.num_tokens,
            scope.num_sequences)


def _fresh(saved, inputs) -> list[torch.Tensor]:
    """The saved tensors, contiguous, each cloned where it shares memory with an input or an earlier
    one (an operator's outputs may alias neither). Routing fields that are inputs are left out
    before this (router.routing_inputs); what still aliases is small: combine weights that are
    their scores (no renormalisation, no scaling) share one [S, k] tensor."""
    seen_ids, seen_ptrs = set(), set()
    for t in inputs:
        if t is not None:
            seen_ids.add(id(t))
            if t.untyped_storage().nbytes():
                seen_ptrs.add(t.untyped_storage().data_ptr())
    out = []
    for t in saved:
        storage = t.untyped_storage()
        if id(t) in seen_ids or (storage.nbytes() and storage.data_ptr() in seen_ptrs):
            t = t.clone()
        t = t.contiguous()
        seen_ids.add(id(t))
        if t.untyped_storage().nbytes():
            seen_ptrs.add(t.untyped_storage().data_ptr())
        out.append(t)
    return out


def _shaped(out: torch.Tensor, shape) -> torch.Tensor:
    """out [S, H] as a tensor of `shape` [..., H] that is not a view: one that shares out's storage
    (out itself is dropped). A view would be the caller's output too, and an in-place op on it can
    cut the graph of the hooks FSDP2 puts on a module's output (it warns about one)."""
    out = out.contiguous()
    return out.new_empty(0).set_(out.untyped_storage(), out.storage_offset(), shape, out.view(shape).stride())


class MoEAutograd:
    """The registered autograd of shardmoe::moe_forward: what it saves, and its backward."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        handle, x, present, absent = inputs
        ctx.handle, ctx.absent, ctx.num_present = handle, list(absent), len(present)
        ctx.save_for_backward(x, *present, *output[2])
        # no zero gradients for the saved outputs (h alone is [N, 2F]): nothing differentiates them
        ctx.set_materialize_grads(False)

    @staticmethod
    @not_twice_differentiable
    def backward(ctx, grad_out, grad_loss, grad_saved):
        x, *rest = ctx.saved_tensors
        present, saved = rest[:ctx.num_present], rest[ctx.num_present:]
        if grad_out is None:  # only the loss was used
            grad_out = torch.zeros_like(x)
        if grad_loss is None:  # only the output was used
            grad_loss = x.new_zeros((), dtype=accumulation_dtype(x.dtype))
        wanted = list(ctx.needs_input_grad[2])
        grads = iter(torch.ops.shardmoe.moe_backward(ctx.handle, grad_out, grad_loss, x, present, ctx.absent, saved,
                                                     wanted))
        grad_x = next(grads)
        return None, grad_x, [next(grads) if want else None for want in wanted], None


_forward_op = torch.library.custom_op("shardmoe::moe_forward", moe_forward, mutates_args=())
_forward_op.register_fake(moe_fake_forward)
_forward_op.register_autograd(MoEAutograd.backward, setup_context=MoEAutograd.setup_context)
_backward_op = torch.library.custom_op("shardmoe::moe_backward", moe_backward, mutates_args=())
_backward_op.register_fake(moe_fake_backward)
