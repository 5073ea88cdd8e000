"""cpu_gemm: the experts' GEMMs side by side, one per thread, against float64 products; skewed
routing (an expert with a thread's share of the rows or more), empty experts, transposed weights;
the GEMMs as torch operators (torch.library.opcheck) and, with cpu.glu_backward_one_pass, under
torch.compile(fullgraph=True)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardmoe
from shardmoe.moe import cpu
from shardmoe.moe.cpu import CpuOps
from shardmoe.rows import Groups
from shardmoe.settings import SETTINGS


def experts_mm(rows, weight, sizes, out):
    """out[rows of e] = rows[rows of e] @ weight[e], by the side-by-side GEMM operator."""
    torch.ops.shardmoe_gemm.experts_mm(rows, weight, list(sizes), out)
    return out


def experts_weight_grad(grad_rows, in_rows, sizes):
    """[E, O, K]: grad_rows[rows of e]^T @ in_rows[rows of e], by the side-by-side GEMM operator."""
    out = grad_rows.new_empty((len(sizes), grad_rows.shape[1], in_rows.shape[1]))
    torch.ops.shardmoe_gemm.experts_weight_grad(grad_rows, in_rows, list(sizes), out)
    return out


@pytest.fixture
def two_threads():
    if not cpu.library_loaded():
        pytest.skip("the C++ library does not build here")
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def _bound(dtype, k, *operands):
    """|error| bound of a float32-accumulated dot of length k, rounded to dtype."""
    scale = max(float(t.double().abs().max()) for t in operands) ** 2 * k
    return scale * (k * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sizes", [(5, 0, 9, 3, 7, 1), (2, 40, 1, 0)], ids=["even", "skewed"])
def test_experts_mm_and_weight_grad_are_the_per_expert_products(two_threads, dtype, sizes):
    gen = torch.Generator().manual_seed(0)
    n, k, o = sum(sizes), 24, 20
    rows = torch.randn(n, k, generator=gen).to(dtype)
    weight = torch.randn(len(sizes), o, k, generator=gen).to(dtype).transpose(1, 2)  # [E, K, O], strided
    grad = torch.randn(n, o, generator=gen).to(dtype)
    assert CpuOps.decide(rows).gemm_fits(Groups.from_counts(torch.tensor(sizes)), rows, weight)
    out = experts_mm(rows, weight, sizes, torch.full((n, o), float("nan"), dtype=dtype))
    weight_grad = experts_weight_grad(grad, rows, sizes)
    start = 0
    for e, size in enumerate(sizes):
        part = slice(start, start + size)
        want = rows[part].double() @ weight[e].double()
        if size:
            assert (out[part].double() - want).abs().max() <= _bound(dtype, k, rows, weight)
        want_grad = grad[part].double().t() @ rows[part].double()
        assert (weight_grad[e].double() - want_grad).abs().max() <= _bound(dtype, max(size, 1), grad, rows)
        start += size
    assert not out.isnan().any()
    # the same call again gives the same bits, whichever thread took which expert
    assert torch.equal(out, experts_mm(rows, weight, sizes, torch.empty_like(out)))


# Experts of exactly one block, of blocks plus a rest, under a block, empty, one large enough to
# run on both threads (2 * 230 >= the 395 rows), and a last one with no rows after it.
BLOCK_SIZES = (32, 230, 0, 64, 31, 33, 5)
BLOCK = 32


def _with_row_gap(t: torch.Tensor) -> torch.Tensor:
    """A copy of t [N, D] whose rows are D + 8 elements apart (rows_finite must follow the stride)."""
    return torch.empty(t.shape[0], t.shape[1] + 8, dtype=t.dtype)[:, :t.shape[1]].copy_(t)


def test_row_blocks_and_zero_padded_weight_grads_are_the_per_expert_products(two_threads):
    """bf16 GEMMs run over whole 32-row blocks plus the rest, and each weight gradient over its rows
    zero-padded to a block (the wider operand read in place where the rows after the expert's
    exist and are finite, copied zero-padded too where not: the last expert, a non-finite value)
    for both orders of the narrower operand; a non-finite value leaves every other expert's
    gradient finite."""
    gen = torch.Generator().manual_seed(1)
    n, k, o = sum(BLOCK_SIZES), 40, 24
    rows = _with_row_gap(torch.randn(n, k, generator=gen).to(torch.bfloat16))
    weight = torch.randn(len(BLOCK_SIZES), k, o, generator=gen).to(torch.bfloat16)
    grad = torch.randn(n, o, generator=gen).to(torch.bfloat16)
    out = experts_mm(rows, weight, BLOCK_SIZES, torch.full((n, o), float("nan"), dtype=torch.bfloat16))
    starts = [sum(BLOCK_SIZES[:e]) for e in range(len(BLOCK_SIZES))]
    for e, (start, size) in enumerate(zip(starts, BLOCK_SIZES)):
        if size:
            want = rows[start:start + size].double() @ weight[e].double()
            assert (out[start:start + size].double() - want).abs().max() <= _bound(torch.bfloat16, k, rows, weight)
    owner = 3  # the wide operand's row 1 of expert 3 is poisoned: expert 1's padding would read it
    for g, x in ((grad, rows), (rows, grad)):  # the narrower operand: grad, then in_rows
        for poison in (False, True):
            wide = _with_row_gap(x if g.shape[1] <= x.shape[1] else g)
            if poison:
                wide[starts[owner] + 1, 3] = float("inf")
            g_used, x_used = (g, wide) if g.shape[1] <= x.shape[1] else (wide, x)
            weight_grad = experts_weight_grad(g_used, x_used, BLOCK_SIZES)
            for e, (start, size) in enumerate(zip(starts, BLOCK_SIZES)):
                if poison and e == owner:
                    assert not weight_grad[e].isfinite().all()
                    continue
                want = g_used[start:start + size].double().t() @ x_used[start:start + size].double()
                bound = _bound(torch.bfloat16, max(size, 1), g, x)
                assert (weight_grad[e].double() - want).abs().max() <= bound, (e, poison)


_SHAPES_RUN = """
import torch
from shardmoe.moe import cpu
assert cpu.library_loaded()
torch.set_num_threads(2)
sizes = {sizes}
n = sum(sizes)
rows, grad = torch.randn(n, 64).bfloat16(), torch.randn(n, 24).bfloat16()
torch.ops.shardmoe_gemm.experts_mm(rows, torch.randn(len(sizes), 64, 48).bfloat16(), list(sizes), torch.empty(n, 48).bfloat16())
torch.ops.shardmoe_gemm.experts_weight_grad(grad, rows, list(sizes), torch.empty(len(sizes), 24, 64).bfloat16())
torch.ops.shardmoe_gemm.experts_weight_grad(rows, grad, list(sizes), torch.empty(len(sizes), 64, 24).bfloat16())
"""


def test_bf16_gemms_meet_only_block_shapes(two_threads):
    """What the blocks are for: every bf16 GEMM oneDNN runs (its verbose log, a child process with
    ONEDNN_VERBOSE=1) has a row count that is a whole number of blocks or under one block
    (experts_mm, rows [M, 64]), and every weight gradient's reduction is whole blocks, including
    the last expert's (copied zero-padded)."""
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.run([sys.executable, "-c", _SHAPES_RUN.format(sizes=BLOCK_SIZES)], capture_output=True,
                           text=True, env={**os.environ, "ONEDNN_VERBOSE": "1"}, cwd=repo, timeout=120)
    assert child.returncode == 0, child.stderr
    executed = [line for line in child.stdout.splitlines() if ",exec,cpu,matmul," in line]
    if not executed:
        pytest.skip("oneDNN runs no bf16 matmul here (no verbose log)")
    shapes = [tuple(map(int, m)) for m in re.findall(r",(\d+)x(\d+):(\d+)x(\d+),", "\n".join(executed))]
    assert len(shapes) == len(executed), f"unread verbose lines: {executed[:3]}"
    forward = [m for m, kk, _, nn in shapes if (kk, nn) == (64, 48)]
    reductions = [kk for o, kk, _, kw in shapes if (o, kw) in ((24, 64), (64, 24))]
    assert all(m % 32 == 0 or m < 32 for m in forward), forward
    # each expert's whole blocks and its rest (230 = 224 + 6); a 1-row GEMM (33 = 32 + 1) does not
    # reach oneDNN (torch keeps tiny bf16 products for itself), so it is not in the log
    splits = [m for size in BLOCK_SIZES for m in (size // BLOCK * BLOCK, size % BLOCK) if m > 1]
    assert sorted(forward) == sorted(splits)
    padded = [-(-size // BLOCK) * BLOCK for size in BLOCK_SIZES if size]
    assert sorted(reductions) == sorted(2 * padded)  # both operand orders


def test_the_ops_refuse_bad_sizes_and_operands_before_any_work(two_threads):
    """A size or operand that would make a GEMM read outside the operands (or resize a view of out
    from a worker thread) raises, naming the argument, what was expected and what came."""
    op = torch.ops.shardmoe_gemm
    rows, weight, out, grad = torch.randn(7, 4), torch.randn(3, 4, 5), torch.empty(7, 5), torch.randn(7, 5)
    refused = [
        (op.experts_mm, (rows, weight, [2, -1, 3], out), "sizes: expected row counts >= 0, got -1 for expert 1"),
        (op.experts_mm, (rows, weight, [2, 4, 3], out), "expected at most the operands' 7 rows in all"),
        (op.experts_mm, (rows, weight, [2, 1, 3], out[:5]), "expected at most the operands' 5 rows in all"),
        (op.experts_mm, (rows, weight[:2], [2, 1, 3], out), r"weight: expected shape \[3, 4, 5\], got \[2, 4, 5\]"),
        (op.experts_mm, (rows, weight, [2, 1, 3], torch.empty(7, 6)), r"out: expected shape \[7, 5\], got \[7, 6\]"),
        (op.experts_mm, (rows, weight.double(), [2, 1, 3], out), "weight: expected dtype Float, got Double"),
        (op.experts_weight_grad, (grad, rows[:6], [2, 1, 3], torch.empty(3, 5, 4)),
         r"in_rows: expected shape \[7, 4\], got \[6, 4\]"),
        (op.experts_weight_grad, (grad, rows, [2, 1, 3], torch.empty(3, 4, 5)),
         r"out: expected shape \[3, 5, 4\], got \[3, 4, 5\]"),
        (op.experts_weight_grad, (grad, rows, [2, 9], torch.empty(2, 5, 4)), "expected at most the operands' 7 rows"),
    ]
    for fn, args, message in refused:
        with pytest.raises(RuntimeError, match=message):
            fn(*args)


def test_what_it_does_not_take_stays_on_the_loop(two_threads, monkeypatch):
    x, two, one = torch.randn(4, 3), Groups.from_counts(torch.tensor([1, 3])), Groups.from_counts(torch.tensor([4]))
    ops = CpuOps.decide(x)
    assert ops.gemm_fits(two, x)
    assert not ops.gemm_fits(one, x)  # one expert: nothing to run side by side
    assert not ops.gemm_fits(two, x.double())
    assert not ops.gemm_fits(two, x, x.to(torch.bfloat16))
    with torch.enable_grad():
        assert not ops.gemm_fits(two, x.requires_grad_())
    torch.set_num_threads(1)
    assert not CpuOps.decide(x.detach()).gemm_fits(two, x.detach())
    torch.set_num_threads(2)
    monkeypatch.setattr(SETTINGS, "experts_mm", False)
    assert not CpuOps.decide(x.detach()).gemm_fits(two, x.detach())


def test_a_forwards_decision_is_taken_as_given(two_threads, monkeypatch):
    """With the forward's CpuOps, gemm_fits checks only the operands: the settings and the thread
    count are read once, by CpuOps.decide."""
    x, two = torch.randn(4, 3), Groups.from_counts(torch.tensor([1, 3]))
    ops = CpuOps.decide(x)
    assert (ops.elementwise, ops.side_by_side) == (True, True)
    assert not CpuOps(elementwise=True).gemm_fits(two, x)
    monkeypatch.setattr(SETTINGS, "experts_mm", False)
    torch.set_num_threads(1)
    assert CpuOps(side_by_side=True).gemm_fits(two, x)
    assert not CpuOps(side_by_side=True).gemm_fits(two, x.double())
    ops = CpuOps.decide(x)
    assert (ops.elementwise, ops.side_by_side) == (True, False)


def test_layer_with_and_without_side_by_side_gemms(two_threads, monkeypatch):
    """fp32 layer, forward and backward: the same results to float32 round-off either way."""
    torch.manual_seed(0)
    layer = shardmoe.MoE(32, 48, 6, 2)
    x = torch.randn(64, 32)

    def step():
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = layer(xg)
        out.square().sum().backward()
        return [out.detach(), xg.grad, *(p.grad for p in layer.parameters())]

    side_by_side = step()
    monkeypatch.setattr(SETTINGS, "experts_mm", False)
    loop = step()
    for a, b in zip(side_by_side, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["experts_mm", "experts_weight_grad"])
def test_gemm_is_a_proper_torch_operator(two_threads, name):
    """torch.library.opcheck: out is marked as written (and nothing else), the op runs under
    FakeTensorMode and through AOT dispatch with dynamic shapes to its eager results; and its Meta
    kernel takes meta tensors and writes nothing."""
    gen = torch.Generator().manual_seed(0)
    sizes, k, o = [2, 0, 5], 4, 3
    rows, grad = torch.randn(7, k, generator=gen), torch.randn(7, o, generator=gen)
    args = {"experts_mm": (rows, torch.randn(3, o, k, generator=gen).transpose(1, 2), sizes, torch.empty(7, o)),
            "experts_weight_grad": (grad, rows, sizes, torch.empty(3, o, k))}[name]
    op = getattr(torch.ops.shardmoe_gemm, name)
    torch.library.opcheck(op, args)
    assert op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)) is None


def test_glu_expert_backward_compiles_to_the_eager_bits(two_threads):
    """The glu expert's backward as the torch backend runs it on CPU: g Wdown (experts_mm), the
    one-pass glu_backward_one_pass writing a over g Wdown, dWgate_up (experts_weight_grad). Under
    torch.compile(fullgraph=True) Dynamo traces the wrappers into one graph (no break: they call
    torch.ops directly and the ops have Meta kernels), the written buffers are functionalized, and
    the compiled function runs the same kernels on the same operands: eager's bits."""
    from shardmoe.moe import cpu

    gen = torch.Generator().manual_seed(0)
    sizes, hidden, ffn = (5, 0, 9, 3), 12, 10
    n = sum(sizes)
    g, x = torch.randn(n, hidden, generator=gen), torch.randn(n, hidden, generator=gen)
    h, w = torch.randn(n, 2 * ffn, generator=gen), torch.rand(n, generator=gen)
    down_t = torch.randn(len(sizes), ffn, hidden, generator=gen).transpose(1, 2)  # [E, H, F], strided

    def backward(g, down_t, h, w, x):
        g_down = experts_mm(g, down_t, sizes, g.new_empty(n, ffn))
        a, grad_h, dots = cpu.glu_backward_one_pass(h, g_down, w, "silu", a_out=g_down)
        return a, grad_h, dots, experts_weight_grad(grad_h, x, sizes)

    eager = backward(g, down_t, h, w, x)
    compiled = torch.compile(backward, fullgraph=True)(g, down_t, h, w, x)
    for want, got in zip(eager, compiled):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
