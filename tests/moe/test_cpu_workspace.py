"""The layer's workspace: blocks lent until nothing else refers to them, reused across steps, and
forward/backward exact in float64 against the independent reference whatever runs between a
forward and its backward (gradient accumulation, two layers, activation checkpointing), with
garbage planted in every free block before each step."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import shardmoe
from shardmoe.moe.reference import reference_forward_backward
from shardmoe.moe.cpu import Workspace


def test_block_is_reused_only_after_its_tensors_are_gone():
    ws = Workspace(min_bytes=0)
    a = ws.empty((64, 8), torch.float32, "cpu")
    b = ws.empty((64, 8), torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr()  # a is still alive: never lent twice
    a_ptr, resident = a.data_ptr(), ws.resident_bytes
    del a
    c = ws.empty((32, 8), torch.float64, "cpu")  # fits a's block (same bytes)
    assert c.data_ptr() == a_ptr and ws.resident_bytes == resident
    assert resident == 2 * 64 * 8 * 4  # first blocks: the request's size


def test_growth_replaces_smaller_free_blocks_and_release_forgets_them():
    ws = Workspace(min_bytes=0)
    small = ws.empty((10, 10), torch.float32, "cpu")
    del small
    big = ws.empty((100, 10), torch.float32, "cpu")
    assert ws.resident_bytes == 4000  # the free 400-byte block was dropped
    del big
    bigger = ws.empty((101, 10), torch.float32, "cpu")
    assert ws.resident_bytes == 5000  # grown geometrically: 1.25x the block it replaced
    big = bigger
    ws.release()
    assert ws.resident_bytes == 0
    big.fill_(1.0)  # a lent tensor outlives release()
    assert ws.empty((100, 10), torch.float32, "cpu").data_ptr() != big.data_ptr()


def test_small_requests_bypass_the_pool():
    ws = Workspace()  # default threshold: a few MiB
    ws.empty((16, 16), torch.float32, "cpu")
    assert ws.resident_bytes == 0
    with pytest.raises(ValueError, match="min_bytes: expected >= 0, got -1"):
        Workspace(min_bytes=-1)


def _layer(seed, **kw):
    torch.manual_seed(seed)
    layer = shardmoe.MoE(8, 6, 4, 2, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    layer.workspace = Workspace(min_bytes=0)  # pool every row buffer of these tiny shapes
    return layer


def _plant_garbage(*layers):
    """NaN into every block no tensor refers to: a stale read shows up in every result."""
    for layer in layers:
        for block in layer.workspace._blocks:
            if torch._C._storage_Use_Count(block._cdata) == 1:
                torch.empty(0, dtype=torch.uint8).set_(block).fill_(0xFF)


def _reference(layer, x, grad_out):
    params = {n: p.detach() for n, p in layer.named_parameters()}
    return reference_forward_backward(x, params, layer.config, grad_out)


def _assert_close(got, want):
    assert (got - want).abs().max() <= 1e-10 * max(want.abs().max(), 1e-3)


@pytest.mark.parametrize("kw", [dict(expert="glu", activation="silu", bias=True, aux_loss_coef=0.1),
                                dict(expert="glu", activation="gelu", capacity_factor=0.75),
                                dict(expert="mlp", bias=True, activation="gelu", capacity_factor=0.75)])
def test_gradient_accumulation_two_forwards_then_two_backwards(kw):
    layer = _layer(0, **kw)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(13, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    grads = [torch.randn(13, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    refs = [_reference(layer, x, g) for x, g in zip(xs, grads)]  # (out, aux, grads) per micro-batch
    want = {n: sum(ref[2][n] for ref in refs) for n, _ in layer.named_parameters()}
    for step in range(2):  # the second step reuses the first one's blocks
        _plant_garbage(layer)
        layer.zero_grad(set_to_none=True)
        outs = []
        for x in xs:
            outs.append((layer(x), layer.aux_loss))
            # the forward's stats report the pool as that forward leaves it (a backward may grow it)
            assert layer.stats["workspace_bytes"] == layer.workspace.resident_bytes > 0
            _plant_garbage(layer)
        for (out, aux), g in zip(reversed(outs), reversed(grads)):
            out.backward(g)  # the aux loss's gradient rides on out's backward
            _plant_garbage(layer)
        for name, p in layer.named_parameters():
            _assert_close(p.grad, want[name])
        for (out, _), x, (ref_out, _, ref) in zip(outs, xs, refs):
            _assert_close(out, ref_out)
            _assert_close(x.grad if step == 0 else x.grad / 2, ref["x"])


def test_two_layers_under_activation_checkpointing():
    first, second = _layer(0), _layer(1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(11, 8, generator=gen, dtype=torch.float64)

    def block(t):
        _plant_garbage(first, second)
        return second(first(t))

    out = checkpoint(block, x, use_reentrant=False)  # backward reruns both forwards
    _plant_garbage(first, second)
    out.backward(grad_out)

    mid = first(x.detach()).detach()
    _, _, ref2 = _reference(second, mid, grad_out)
    _, _, ref1 = _reference(first, x, ref2["x"])
    _assert_close(x.grad, ref1["x"])
    for layer, ref in ((first, ref1), (second, ref2)):
        for name, p in layer.named_parameters():
            _assert_close(p.grad, ref[name])


def test_layers_sharing_one_pool_are_exact_and_hold_less():
    """Three stacked layers on one pool (as shardmoe.Transformer builds them), garbage planted in
    the free blocks between every forward and backward: exact against the reference chain, and
    the pool holds less than the three layers' own pools do."""
    layers = [_layer(seed) for seed in range(3)]
    pool = Workspace(min_bytes=0)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(17, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(17, 8, generator=gen, dtype=torch.float64)

    def chain(t):
        for layer in layers:
            t = layer(t)
            _plant_garbage(layers[0])
        return t

    for layer in layers:  # each layer on its own pool first: what sharing saves
        layer.workspace = Workspace(min_bytes=0)
    chain(x.detach()).backward(grad_out)
    own = sum(layer.workspace.resident_bytes for layer in layers)
    for layer in layers:
        layer.workspace = pool
        layer.zero_grad(set_to_none=True)
    chain(x).backward(grad_out)
    assert 0 < pool.resident_bytes < own

    inputs = [x.detach()]
    for layer in layers[:-1]:
        inputs.append(layer(inputs[-1]).detach())
    grad = grad_out
    for layer, layer_in in zip(reversed(layers), reversed(inputs)):
        _, _, ref = _reference(layer, layer_in, grad)
        for name, p in layer.named_parameters():
            _assert_close(p.grad, ref[name])
        grad = ref["x"]
    _assert_close(x.grad, grad)


def test_to_releases_the_workspace():
    layer = _layer(0)
    layer(torch.randn(5, 8, dtype=torch.float64)).sum().backward()
    assert layer.workspace.resident_bytes > 0
    layer.to(torch.float32)
    assert layer.workspace.resident_bytes == 0


def test_a_copy_gets_an_empty_pool_of_the_same_settings():
    import copy

    layer = _layer(0)
    layer(torch.randn(5, 8, dtype=torch.float64)).sum().backward()
    twin = copy.deepcopy(layer)
    assert twin.workspace is not layer.workspace and twin.workspace.resident_bytes == 0
    assert twin.workspace.min_bytes == 0
    layer.workspace = None
    assert copy.deepcopy(layer).workspace is None


def test_two_threads_are_never_lent_one_block():
    """The window between choosing a free block and making the tensor on it (torch releases the GIL
    there) is held open with a barrier: both threads reach it at once unless lending is serialised,
    and then both would get the one free block."""
    import threading

    from shardmoe.moe.cpu import Workspace

    barrier = threading.Barrier(2, timeout=0.5)

    class Racy(Workspace):
        def _choose_block(self, nbytes, device):
            block = super()._choose_block(nbytes, device)
            try:
                barrier.wait()  # with the lock the other thread never arrives: the wait times out
            except threading.BrokenBarrierError:
                pass
            return block

    pool = Racy(min_bytes=0)
    pool.empty((64, 64), torch.float32, "cpu")  # dropped at once: one free block of the size both will ask for
    lent = []
    threads = [threading.Thread(target=lambda: lent.append(pool.empty((64, 64), torch.float32, "cpu")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(lent) == 2 and lent[0].untyped_storage().data_ptr() != lent[1].untyped_storage().data_ptr()


def test_layers_sharing_a_pool_in_four_threads_match_the_sequential_result():
    import threading

    import shardmoe
    from shardmoe.moe import cpu

    torch.manual_seed(0)
    layers = [shardmoe.MoE(64, 128, 4, 2) for _ in range(2)]
    cpu.share(layers)
    for layer in layers:
        layer.workspace.min_bytes = 0  # pool every buffer, so the pool is busy
    inputs = [torch.randn(96, 64, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    def step(x):
        h = x.clone().requires_grad_()
        out = layers[1](layers[0](h))
        out.square().sum().backward()
        return out.detach(), h.grad

    expected = [step(x) for x in inputs]
    got = [None] * len(inputs)

    def worker(k):
        for i in range(k, len(inputs), 4):
            got[i] = step(inputs[i])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (out, grad), (out_ref, grad_ref) in zip(got, expected):
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
        torch.testing.assert_close(grad, grad_ref, rtol=0, atol=0)
