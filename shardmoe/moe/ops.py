"""The MoE Function as torch operators, so that torch.compile(fullgraph=True) traces a model
holding shardmoe layers without a graph break, and eager runs the very same code.

  shardmoe::moe_forward(handle, x, present, absent) -> (out [..., H], loss [], made)
  shardmoe::moe_backward(handle, grad_out, grad_loss, x, present, absent, made) -> [dx, d(each input that has one)]

x [..., H] is any number of tokens S in any leading shape (the operators flatten it to [S, H]),
and out has x's shape without being a view of anything the caller holds.
Both run with autocast off: the caller casts what should run in autocast's dtype
(moe/precision.py), and the router inside must stay in its float32 accumulation dtype.

The inputs are the router tensors and weights the forward takes after x (moe/function.py: for the
layer gate_weight, gate_bias, correction_bias, token_sequence, then the expert and shared-expert
params; for transformers' seam top_k_index, top_k_weights, then the expert params), some of them
None; the operators take the present ones and a mask of the absent (a list of optional tensors
cannot carry gradients through torch.library's autograd).
made are the tensors the forward makes for its backward (function.SavedForBackward: routing, shared expert,
what the dispatcher kept). Every tensor the backward reads is an input or an output, saved by the
registered autograd through ctx.save_for_backward: saved-tensor hooks and activation
checkpointing see all of it, and a compiled graph holds it like any other activation.

Everything else a forward needs (config, router, dispatcher, workspace, stats) is the owner's: an
object with moe_context(x, inputs) -> MoEContext (shardmoe.MoE; the transformers seam's), registered once for an int handle that the graph carries as a constant. Owners are held
weakly: a handle dies with its layer.

The fake implementations give every output's shape and dtype without computing: N, the kept pairs,
is S k when no capacity can drop a pair and a data-dependent size otherwise (function.moe_fake_forward).
Under compile, routing, dispatch and the stages run inside the operator, as in eager; inductor
fuses around it.
"""
from __future__ import annotations

import itertools
import weakref

import torch

from shardmoe.moe.function import SavedForBackward, MoEContext, moe_backward, moe_fake_forward, moe_forward, not_twice_differentiable
from shardmoe.moe.precision import autocast_off
from shardmoe.rows import accumulation_dtype

_OWNERS: dict[int, weakref.ref] = {}
_HANDLES = itertools.count(1)


def register(owner) -> int:
    """A new handle for `owner` (anything with moe_context(x, inputs) -> MoEContext), held weakly."""
    handle = next(_HANDLES)
    _OWNERS[handle] = weakref.ref(owner, lambda _, handle=handle: _OWNERS.pop(handle, None))
    return handle


def _inputs(present, absent) -> tuple:
    """The inputs, None where absent, from the present tensors and the mask."""
    it = iter(present)
    return tuple(None if a else next(it) for a in absent)


def _call(handle: int, x: torch.Tensor, inputs) -> MoEContext:
    ref = _OWNERS.get(handle)
    owner = None if ref is None else ref()
    if owner is None:
        raise RuntimeError(f"shardmoe::moe_forward: handle {handle} names no live MoE layer (it was freed, or the "
                           "handle was not made by shardmoe.moe.ops.register in this process)")
    return owner.moe_context(x, tuple(inputs))


def fused_moe(handle: int, x: torch.Tensor, *inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [..., H] in x's dtype, loss [] in the acc dtype) of the owner of `handle` on x [..., H] and
    the inputs, differentiable by the explicit six-stage backward."""
    out, loss, _ = torch.ops.shardmoe.moe_forward(handle, x, [t for t in inputs if t is not None],
                                                  [t is None for t in inputs])
    return out, loss


def _fresh(made, inputs) -> list[torch.Tensor]:
    """The made tensors, contiguous, each cloned where it shares memory with an input or an earlier
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
    for t in made:
        storage = t.untyped_storage()
        if id(t) in seen_ids or (storage.nbytes() and storage.data_ptr() in seen_ptrs):
            t = t.clone()
        t = t.contiguous()
        seen_ids.add(id(t))
        if t.untyped_storage().nbytes():
            seen_ptrs.add(t.untyped_storage().data_ptr())
        out.append(t)
    return out


@torch.library.custom_op("shardmoe::moe_forward", mutates_args=())
def _moe_forward(handle: int, x: torch.Tensor, present: list[torch.Tensor],
                 absent: list[bool]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    inputs = _inputs(present, absent)
    tokens = x.reshape(-1, x.shape[-1])
    call = _call(handle, tokens, inputs)
    with autocast_off(x.device.type):
        out, loss, made = moe_forward(call, tokens, inputs)
    return _shaped(out, x.shape), loss, _fresh(made.flat(_routing_inputs(call, inputs)), (x, *present))


def _shaped(out: torch.Tensor, shape) -> torch.Tensor:
    """out [S, H] as a tensor of `shape` [..., H] that is not a view: one that shares out's storage
    (out itself is dropped). A view would be the caller's output too, and an in-place op on it can
    cut the graph of the hooks FSDP2 puts on a module's output (it warns about one)."""
    out = out.contiguous()
    return out.new_empty(0).set_(out.untyped_storage(), out.storage_offset(), shape, out.view(shape).stride())


@_moe_forward.register_fake
def _moe_forward_fake(handle, x, present, absent):
    inputs = _inputs(present, absent)
    tokens = x.reshape(-1, x.shape[-1])
    call = _call(handle, tokens, inputs)
    out, loss, made = moe_fake_forward(call, tokens, inputs, torch.library.get_ctx().new_dynamic_size)
    return out.new_empty(x.shape), loss, list(made.flat(_routing_inputs(call, inputs)))


def _routing_inputs(call: MoEContext, inputs) -> dict:
    """The routing fields that are inputs: saved as inputs, not again among the made outputs."""
    return call.router.routing_inputs(tuple(inputs[:call.router.num_tensors]))


def _gradient_mask(call: MoEContext, inputs) -> list[bool]:
    """Which inputs get a gradient (the backward returns dx, then one tensor for each of these)."""
    n = call.router.num_tensors
    return [*call.router.gradient_mask(tuple(inputs[:n])), *(t is not None for t in inputs[n:])]


@torch.library.custom_op("shardmoe::moe_backward", mutates_args=())
def _moe_backward(handle: int, grad_out: torch.Tensor, grad_loss: torch.Tensor, x: torch.Tensor,
                  present: list[torch.Tensor], absent: list[bool], made: list[torch.Tensor]) -> list[torch.Tensor]:
    inputs = _inputs(present, absent)
    tokens = x.reshape(-1, x.shape[-1])
    call = _call(handle, tokens, inputs)
    with autocast_off(x.device.type):
        grad_x, *grads = moe_backward(call, tokens, inputs, SavedForBackward.restore(call.config, made, _routing_inputs(call, inputs)),
                                      grad_out.reshape(tokens.shape), grad_loss)
    mask = _gradient_mask(call, inputs)
    return [grad_x.reshape(x.shape).contiguous(), *(g.contiguous() for g, wanted in zip(grads, mask) if wanted)]


@_moe_backward.register_fake
def _moe_backward_fake(handle, grad_out, grad_loss, x, present, absent, made):
    inputs = _inputs(present, absent)
    mask = _gradient_mask(_call(handle, x, inputs), inputs)
    return [x.new_empty(x.shape), *(t.new_empty(t.shape) for t, wanted in zip(inputs, mask) if wanted)]


class FusedMoE:
    """The registered autograd of shardmoe::moe_forward: what it saves, and its backward."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        handle, x, present, absent = inputs
        ctx.handle, ctx.absent, ctx.num_present = handle, list(absent), len(present)
        ctx.save_for_backward(x, *present, *output[2])
        # no zero gradients for the made outputs (h alone is [N, 2F]): nothing differentiates them
        ctx.set_materialize_grads(False)

    @staticmethod
    @not_twice_differentiable
    def backward(ctx, grad_out, grad_loss, grad_made):
        x, *rest = ctx.saved_tensors
        present, made = rest[:ctx.num_present], rest[ctx.num_present:]
        if grad_out is None:  # only the loss was used
            grad_out = torch.zeros_like(x)
        if grad_loss is None:  # only the output was used
            grad_loss = x.new_zeros((), dtype=accumulation_dtype(x.dtype))
        grads = iter(torch.ops.shardmoe.moe_backward(ctx.handle, grad_out, grad_loss, x, present, ctx.absent, made))
        grad_x = next(grads)
        inputs = _inputs(present, ctx.absent)
        mask = _gradient_mask(_call(ctx.handle, x, inputs), inputs)
        grad_present = [next(grads) if wanted else None for t, wanted in zip(inputs, mask) if t is not None]
        return None, grad_x, grad_present, None


_moe_forward.register_autograd(FusedMoE.backward, setup_context=FusedMoE.setup_context)
