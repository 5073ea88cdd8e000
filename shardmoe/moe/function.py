"""FusedMoE: the one autograd.Function of the MoE layer, with an explicit backward.

Every way into shardmoe's MoE runs through it: the MoE module on one process, the same module
with expert parallelism, and transformers' experts seam (shardmoe.hf). What differs between them
is handed in (MoECall): where the routing comes from (the router: moe/routing.py GateRouter or
GivenRouting) and how the rows reach the experts and come back (the dispatcher: moe/dispatch.py's
LocalDispatcher, or expert parallelism's, shardmoe/parallel/expert_parallel.py).

Forward (S tokens, H hidden, E experts, k top-k, N kept pairs, sorted by expert):
  routing = dispatcher.route(router, x)          weights w [S, k], row_pair [N]
  out     = dispatcher.forward(backend, x)       dispatch x rows -> y = experts(xs) [N, H]
                                                 -> combine out_t = sum_j w_tj y_j(x_t)   [S, H]
  out_t  += s_t shared(x_t)                      (shared_ffn_size > 0: moe/shared_experts.py)
  loss    = router.loss(routing)                 aux + z + sequence-wise, scalar

Backward, in the six stages of the FlashMoE task design (docs/architecture.md):
  1 grad_combine  2 grad_gate_combine  3 grad_post_gemm  4 grad_pre_gemm   (backend, on rows)
  5 grad_input_combine                                                      (dispatcher)
  6 grad_gate_gemm                                                          (router)
The shared expert's own stages 3, 2, 4 and its gate's gradient run after 5 and add into dx.

Saved for backward (all through ctx.save_for_backward, so saved-tensor hooks see them): x [S, H],
the router tensors its backward reads (gate_weight, gate_bias), the expert weights, the routing
(routing.Routing: probs [S, E], logsumexp [S], top_idx [S, k] int64, top_prob [S, k], weight
[S, k] acc dtype, counts [E] x2, row_pair [N] int64, and the router options' extras), the shared
expert's h_shared [S, 2Fs] and s [S], what the dispatcher keeps (expert parallelism: the received
rows and their order) and the expert's "glu": h [N, 2F]; "mlp": z1 [N, P], z2 [N, H]. The expert
output y is not saved: "glu" takes the gate dot as (g Wdown) . a, "mlp" recomputes act_out(z2).
Per token that is H + k*2F (glu) elements of the input dtype plus the routing state: docs/moe.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch

from shardmoe.moe import backends
from shardmoe.moe import shared_experts as shared_ex
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.routing import Routing
from shardmoe.moe.workspace import Workspace
from shardmoe.rows import accumulation_dtype


def expert_param_names(config: MoEConfig) -> tuple[str, ...]:
    """Names of the expert parameters, in the order FusedMoE.apply takes them (the glu biases only
    with config.bias; the "mlp" b1, b2 always, None without bias)."""
    if config.expert == "glu":
        return ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias") if config.bias \
            else ("gate_up_proj", "down_proj")
    return ("w1", "b1", "w2", "b2")


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
        if not torch.is_grad_enabled() or not any(ctx.needs_input_grad):
            return grads
        tensors = [i for i, g in enumerate(grads) if g is not None]
        # detached leaves that require grad, so the raising node gets an edge to hang on
        wrapped = _SecondDerivative.apply(backward.__qualname__,
                                          *(grads[i].detach().requires_grad_() for i in tensors))
        out = list(grads)
        for i, g in zip(tensors, wrapped):
            out[i] = g
        return tuple(out)

    return wrapper


@dataclass
class MoECall:
    """The non-tensor arguments of one FusedMoE.apply.

    config: the layer's MoEConfig; router: GateRouter or GivenRouting (moe/routing.py); dispatcher:
    moe/dispatch.py's protocol; workspace: the pool of large row buffers (None: fresh ones);
    stats: filled in place with the forward's routing statistics."""

    config: MoEConfig
    router: object
    dispatcher: object
    workspace: Workspace | None = None
    stats: dict | None = None


@dataclass
class Saved:
    """What FusedMoE's backward reads, flattened into ctx.save_for_backward and back.
    Field order is the flattening order; the tuple fields' lengths are kept beside."""

    x: torch.Tensor
    router: tuple
    weights: tuple
    routing: Routing
    shared: tuple
    dispatched: tuple

    def flat(self) -> tuple[tuple, tuple[int, ...]]:
        lengths = (len(self.router), len(self.weights), len(self.shared), len(self.dispatched))
        return (self.x, *self.router, *self.weights, *self.routing.tensors(), *self.shared, *self.dispatched), lengths

    @classmethod
    def restore(cls, tensors: tuple, lengths: tuple[int, ...]) -> "Saved":
        n_router, n_weights, n_shared, _ = lengths
        n_routing = len(fields(Routing))
        x, rest = tensors[0], tensors[1:]
        router, rest = rest[:n_router], rest[n_router:]
        weights, rest = rest[:n_weights], rest[n_weights:]
        routing, rest = Routing(*rest[:n_routing]), rest[n_routing:]
        return cls(x, tuple(router), tuple(weights), routing, tuple(rest[:n_shared]), tuple(rest[n_shared:]))


class FusedMoE(torch.autograd.Function):
    """apply(call: MoECall, x [S, H], *router tensors, *expert params, *shared params)
    -> (out [S, H] in x's dtype, loss [] in the acc dtype)

    The router tensors are call.router's (router.num_tensors of them); the expert params are in
    expert_param_names(config) order, then the shared expert's in shared_param_names order. The
    stages run on the backend backends.select() picks here; backward uses the same one."""

    @staticmethod
    def forward(ctx, call: MoECall, x, *tensors):
        config, router, dispatcher = call.config, call.router, call.dispatcher
        router_tensors, weights = tensors[:router.num_tensors], tensors[router.num_tensors:]
        expert_weights, shared_weights = split_weights(config, weights)
        params = dict(zip(expert_param_names(config), expert_weights))
        shared = shared_ex.named_shared_params(config, shared_weights)
        with dispatcher.guard():
            dispatcher.prepare(config, x, router_tensors, shared)
            backend = backends.select(config, x, call.workspace)
            routing, state = dispatcher.route(router, x, router_tensors)
            out, dispatched = dispatcher.forward(backend, config, x, routing, state, params)
            shared_saved = ()
            with dispatcher.timed(state, "experts"):
                if shared:
                    shared_out, shared_saved = shared_ex.forward(x, shared, config, dispatcher.reduce_shared("output"))
                    out = out + shared_out  # both in the acc dtype: one rounding below
                out = out.to(x.dtype)
            with dispatcher.timed(state, "combine"):
                loss_routing, num_tokens, num_sequences = dispatcher.loss_scope(routing, state)
                loss = router.loss(loss_routing, num_tokens, num_sequences)
                if call.stats is not None:
                    call.stats.update(dispatcher.stats(config, routing, state, x.shape[0]))
        ctx.call, ctx.backend, ctx.state, ctx.scope = call, backend, state, (num_tokens, num_sequences)
        saved, ctx.lengths = Saved(x, router.saved(router_tensors), weights, loss_routing, shared_saved,
                                   dispatched).flat()
        ctx.save_for_backward(*saved)
        return out, loss

    @staticmethod
    @not_twice_differentiable
    def backward(ctx, grad_out, grad_loss):
        call: MoECall = ctx.call
        config, router, dispatcher, state = call.config, call.router, call.dispatcher, ctx.state
        saved = Saved.restore(ctx.saved_tensors, ctx.lengths)
        x, routing = saved.x, saved.routing
        expert_weights, shared_weights = split_weights(config, saved.weights)
        params = dict(zip(expert_param_names(config), expert_weights))
        grad_out = grad_out.contiguous()
        with dispatcher.guard():
            # stages 1-5
            grad_x, grad_dots, grads = dispatcher.backward(ctx.backend, config, grad_out, x, routing, state,
                                                           saved.dispatched, params)
            with dispatcher.timed(state, "route"):  # stage 6, from dL/dw [S, k] (zero for dropped pairs)
                num_tokens, k = x.shape[0], config.top_k
                grad_weight = x.new_zeros(num_tokens * k, dtype=accumulation_dtype(x.dtype))
                grad_weight[routing.row_pair] = grad_dots
                grad_x_router, router_grads = router.backward(x, saved.router, routing,
                                                              grad_weight.view(num_tokens, k), grad_loss, *ctx.scope)
                if grad_x_router is not None:
                    grad_x = grad_x + grad_x_router
            shared_grads = []
            with dispatcher.timed(state, "experts"):
                if shared_weights:
                    shared = shared_ex.named_shared_params(config, shared_weights)
                    grad_x_shared, named = shared_ex.backward(grad_out, x, saved.shared, shared, config,
                                                              dispatcher.reduce_shared("input"),
                                                              dispatcher.reduce_shared("dot"))
                    grad_x = grad_x + grad_x_shared
                    shared_grads = [named[n] for n in shared]
        expert_grads = [None if g is None else g.to(p.dtype)
                        for g, p in zip((grads[n] for n in expert_param_names(config)), expert_weights)]
        return (None, grad_x.to(x.dtype), *router_grads, *expert_grads, *shared_grads)


def split_weights(config: MoEConfig, weights) -> tuple[tuple, tuple]:
    """(routed expert weights, shared expert weights) of the weights FusedMoE.apply takes."""
    n_expert = len(expert_param_names(config))
    return tuple(weights[:n_expert]), tuple(weights[n_expert:])
