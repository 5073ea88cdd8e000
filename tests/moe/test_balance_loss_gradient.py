"""The balance losses (aux, z, sequence-wise) reach the router through the output's backward in
every recomputation scheme: plain, reentrant and non-reentrant activation checkpointing,
torch.compile, compile around checkpointing; float64 against the autograd reference, with
layer.aux_loss_scale 1 (L = sum(y g) + aux) and 0.5 (L = sum(y g) + aux / 2).

Reentrant checkpointing replays the forward under no_grad and returns only y's graph: a loss
kept as a side tensor missed the gate (its gradient was off by 6.5e-4 at these options)."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import shardmoe
from shardmoe.moe.reference import reference_forward_backward

H, F, E, K = 8, 6, 8, 3
# every balance loss on, with the router options that change their gradients
OPTIONS = dict(aux_loss_coef=0.2, z_loss_coef=0.1, seq_aux_loss_coef=0.3, router_bias=True, capacity_factor=1.0)


def _layer(scale):
    torch.manual_seed(0)
    layer = shardmoe.MoE(H, F, E, K, dtype=torch.float64, aux_loss_scale=scale, **OPTIONS)
    with torch.no_grad():
        layer.gate_bias.normal_(0, 0.3)
    return layer


def _run(layer, scheme, x):
    if scheme == "eager":
        return layer(x)
    if scheme in ("reentrant", "non_reentrant"):
        return checkpoint(layer, x, use_reentrant=scheme == "reentrant")
    torch._dynamo.reset()
    if scheme == "compile":
        return torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert scheme == "compile_checkpoint"
    return torch.compile(lambda t: checkpoint(layer, t, use_reentrant=False), backend="aot_eager")(x)


SCHEMES = ["eager", "reentrant", "non_reentrant", "compile", "compile_checkpoint"]


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_balance_losses_reach_the_router_in_every_scheme(scheme, scale):
    layer = _layer(scale)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, H, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 9, H, generator=gen, dtype=torch.float64)
    y = _run(layer, scheme, x)
    y.backward(grad_out)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    # L = sum(y g) + s aux = s (sum(y g / s) + aux): the reference's gradients at g / s, times s
    ref_y, ref_aux, ref_grads = reference_forward_backward(x.detach(), params, layer.config, grad_out / scale)
    assert (y - ref_y).abs().max() <= 1e-12 * ref_y.abs().max()
    assert abs(layer.aux_loss.item() - ref_aux.item()) <= 1e-12 * abs(ref_aux.item())
    assert not layer.aux_loss.requires_grad  # for logging: adding it to a loss counts nothing twice
    got = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    for name, want in ref_grads.items():
        want = want * scale
        assert (got[name] - want).abs().max() <= 1e-10 * want.abs().max(), (scheme, name)


def test_adding_the_logged_aux_loss_changes_no_gradient():
    """The usual training line, loss = f(y) + layer.aux_loss, gives the gradients of that loss once."""
    layer = _layer(1.0)
    x = torch.randn(12, H, dtype=torch.float64)
    layer(x).square().sum().backward()
    alone = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    (layer(x).square().sum() + layer.aux_loss).backward()
    for a, b in zip(alone, layer.parameters()):
        assert torch.equal(a, b.grad)


def test_scale_none_keeps_the_loss_as_a_graph_node_for_the_caller():
    """aux_loss_scale=None: aux_loss is differentiable and y's backward carries no balance term,
    so (sum(y g) + aux).backward() is the same objective as the default's y.backward(g)."""
    riding, manual = _layer(1.0), _layer(None)
    x = torch.randn(12, H, dtype=torch.float64)
    grad_out = torch.randn(12, H, dtype=torch.float64)
    riding(x).backward(grad_out)
    y = manual(x)
    assert manual.aux_loss.requires_grad
    ((y * grad_out).sum() + manual.aux_loss).backward()
    for (name, a), b in zip(riding.named_parameters(), manual.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-13, atol=1e-15, msg=name)
    manual.zero_grad()
    manual(x).backward(grad_out)  # without the aux term: the router gradient differs
    assert not torch.allclose(manual.gate_weight.grad, riding.gate_weight.grad)


def test_scale_is_checked_and_read_when_backward_runs():
    layer = _layer(1.0)
    for bad in ("1", True, float("nan"), float("inf"), 10**400):
        with pytest.raises(ValueError, match=r"aux_loss_scale: expected None or a finite number, got"):
            layer.aux_loss_scale = bad
    with pytest.raises(ValueError, match=r"aux_loss_scale: expected None or a finite number, got 'x'"):
        shardmoe.MoE(H, F, E, K, aux_loss_scale="x")
    x = torch.randn(12, H, dtype=torch.float64)
    y = layer(x)
    layer.aux_loss_scale = 0.0  # set after the forward: the backward reads it
    y.sum().backward()
    without = layer.gate_weight.grad.clone()
    layer.zero_grad()
    layer.aux_loss_scale = 0.0
    layer(x).sum().backward()
    assert torch.equal(without, layer.gate_weight.grad)


def _chunked_backward(layer, forward, x, grad_out, how):
    """sum(y g), y = forward(x), back-propagated in two pieces through one forward: each half of
    the tokens' part of the loss, by .backward(retain_graph=True) then .backward(), or by
    torch.autograd.grad per piece (per-task gradients) summed. {"x": dL/dx, name: dL/dparam}."""
    y = forward(x)
    pieces = [(y[:, :4] * grad_out[:, :4]).sum(), (y[:, 4:] * grad_out[:, 4:]).sum()]
    if how == "retain_graph":
        pieces[0].backward(retain_graph=True)
        pieces[1].backward()
        return {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    leaves = [x, *layer.parameters()]
    first = torch.autograd.grad(pieces[0], leaves, retain_graph=True, allow_unused=True)
    second = torch.autograd.grad(pieces[1], leaves, allow_unused=True)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    return {n: sum(g for g in (a, b) if g is not None) for n, a, b in zip(names, first, second)}


@pytest.mark.parametrize("how", ["retain_graph", "autograd_grad"])
@pytest.mark.parametrize("scheme", ["eager", "compile"])
def test_two_backwards_through_one_forward_count_the_balance_losses_once(how, scheme):
    """L = sum(y g) + aux, with sum(y g) taken in two pieces: the pieces' gradients sum to L's, the
    balance losses counted once (were each backward through y to add their gradient, the gate's
    gradient would be off by aux's)."""
    layer = _layer(1.0)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, H, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 9, H, generator=gen, dtype=torch.float64)
    forward = layer
    if scheme == "compile":
        torch._dynamo.reset()
        forward = torch.compile(layer, fullgraph=True, backend="aot_eager")
    # a compiled backward runs twice only without donated buffers (torch refuses retain_graph else)
    with torch._functorch.config.patch(donated_buffer=False):
        got = _chunked_backward(layer, forward, x, grad_out, how)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    _, _, want = reference_forward_backward(x.detach(), params, layer.config, grad_out)
    for name, expected in want.items():
        assert (got[name] - expected).abs().max() <= 1e-10 * expected.abs().max(), (how, scheme, name)
