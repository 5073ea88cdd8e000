"""shardops: every op against the same global math on one process (float64, 1e-12), forward and backward.

Single-process tests cover the argument checks and the Unreduced rules. One spawned 4-rank world runs
every op on every (dp, ep, tp) layout of 4 ranks; each rank builds the global tensors from a shared
seed, computes the reference for its own block, and returns the largest error per check. The same
world runs torch.autograd.gradcheck of each op and its dual on the global math (see _gradchecks).

Backward references follow the gradient convention of shardmoe.parallel.shardops: the global loss is the sum of
the ranks' local losses, except that a loss computed on a value replicated by psum counts once per
replica group (every rank of the group holds the whole gradient).
"""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.autograd.gradcheck import GradcheckError, gradcheck

from shardmoe.check.gradcheck import ATOL, EPS, RTOL

from shardmoe.mesh import Mesh
from shardmoe.notation import parse_spec
from shardmoe.parallel.shardops import (
    Unreduced,
    UnreducedError,
    all_gather,
    all_to_all,
    einsum_unreduced,
    identity_psum_grad,
    psum,
    psum_scatter,
    shard,
    unreduced,
)
from shardmoe.testing import run_distributed

TOL = 1e-12
LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
F64 = torch.float64


# -- single process: argument checks and the Unreduced rules ------------------------------------


def test_ops_are_identities_on_a_single_process_mesh():
    mesh = Mesh()
    x = torch.randn(2, 3, 4, dtype=F64)
    assert all_gather("B/d L M/t -> B/d L M", x, mesh) is x
    assert psum_scatter("B/d L M -> B/d L M/t", x, mesh) is x
    assert psum("B L M -> B L M", x, mesh, axes=("d", "e")) is x
    assert identity_psum_grad("B L M -> B L M", x, mesh, axes="t") is x
    assert all_to_all("B/d L/t M -> B/d L M/t", x, mesh) is x
    assert shard("B L M -> B/d L M/t", x, mesh) is x


def test_einsum_contracting_a_sharded_dim_is_unreduced():
    mesh = Mesh()
    a, w = torch.randn(2, 3, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    h = einsum_unreduced("B/d L M, M F/t -> B/d L F/t", a, w)
    assert isinstance(h, torch.Tensor)  # M is not sharded: nothing to reduce
    torch.testing.assert_close(h, a @ w)
    z = einsum_unreduced("B/d L F/t, M F/t -> B/d L M", h, torch.randn(4, 5, dtype=F64))
    assert isinstance(z, Unreduced) and z.axes == {"t"} and z.shape == (2, 3, 4)
    assert "unreduced over {t}" in repr(z)
    grad_w = einsum_unreduced("B/d/e L M, B/d/e L F/t -> M F/t", a, h)
    assert grad_w.axes == {"d", "e"}
    # Reducing on a one-rank mesh gives back the partial sum as a plain tensor.
    assert psum("B/d L M -> B/d L M", z, mesh) is z.partial
    assert psum_scatter("M F/t -> M/d/e F/t", grad_w, mesh) is grad_w.partial
    # A partial reduction keeps the rest unreduced.
    half = psum("M F/t -> M F/t", grad_w, mesh, axes="d")
    assert isinstance(half, Unreduced) and half.axes == {"e"}


def test_linear_arithmetic_keeps_unreduced():
    a, w1, w2 = torch.randn(2, 4, dtype=F64), torch.randn(4, 3, dtype=F64), torch.randn(4, 3, dtype=F64)
    u = einsum_unreduced("T M/t, M/t F -> T F", a, w1)
    v = einsum_unreduced("T M/t, M/t F -> T F", a, w2)
    for combo, expected in [
        (u + v, a @ (w1 + w2)),
        (u - v, a @ (w1 - w2)),
        (-u, -(a @ w1)),
        (2 * u / 4, a @ w1 / 2),
        (sum([u, v]), a @ (w1 + w2)),
    ]:
        assert isinstance(combo, Unreduced) and combo.axes == {"t"}
        torch.testing.assert_close(combo.partial, expected)


def test_einsum_is_linear_in_one_unreduced_operand():
    a, w, v = torch.randn(2, 4, dtype=F64), torch.randn(4, 3, dtype=F64), torch.randn(3, 5, dtype=F64)
    u = einsum_unreduced("T M/t, M/t F -> T F", a, w)
    out = einsum_unreduced("T F, F G -> T G", u, v)
    assert isinstance(out, Unreduced) and out.axes == {"t"}
    torch.testing.assert_close(out.partial, a @ w @ v)
    # Contracting T/d on top carries {t} and adds {d}; a cast keeps the partial sums.
    both = einsum_unreduced("T/d F, T/d G -> F G", unreduced("T/d F", u.partial, "t"), a[:, :2])
    assert both.axes == {"t", "d"} and both.to(torch.float32).partial.dtype == torch.float32
    torch.testing.assert_close(both.partial, u.partial.T @ a[:, :2])


def test_unreduced_marks_without_copying():
    x = torch.randn(3, 4, dtype=F64)
    u = unreduced("N H", x, "t")
    assert u.partial is x and u.axes == {"t"} and u.spec.text == "N H"
    assert psum("N H -> N H", u, None) is x  # mesh=None: one process, the sum is the partial itself
    with pytest.raises(ValueError, match=r"unreduced 'N H/t': axes \['t'\] shard a dim of the spec"):
        unreduced("N H/t", x, "t")
    with pytest.raises(ValueError, match=r"unreduced 'N H': unknown mesh axes \['q'\]"):
        unreduced("N H", x, "q")
    with pytest.raises(ValueError, match="unreduced 'N H': axes is empty"):
        unreduced("N H", x, ())
    with pytest.raises(ValueError, match=r"spec 'N H L' has 3 dims but the tensor has 2"):
        unreduced("N H L", x, "t")


def test_consuming_unreduced_raises():
    a, w = torch.randn(2, 4, dtype=F64), torch.randn(4, 3, dtype=F64)
    u = einsum_unreduced("T M/t, M/t F -> T F", a, w)
    other = einsum_unreduced("T/d M, T/d F -> M F", a, torch.randn(2, 3, dtype=F64))
    with pytest.raises(UnreducedError, match=r"relu got an Unreduced value .*, 'T F' unreduced over \{t\}; reduce it"):
        torch.relu(u)
    with pytest.raises(UnreducedError, match="got an Unreduced value"):
        torch.ones(2, 3) * u
    with pytest.raises(UnreducedError, match=r"cat got an Unreduced value .*, 'T F' unreduced over \{t\}"):
        torch.cat([torch.ones(2, 3), u])  # found inside a list argument too
    with pytest.raises(UnreducedError, match=r"cannot add Tensor to 'T F' unreduced over \{t\}"):
        u + torch.ones(2, 3)
    with pytest.raises(UnreducedError, match="cannot add 'T F' unreduced over {t} and 'M F' unreduced over {d}"):
        u + other
    with pytest.raises(UnreducedError, match="cannot multiply"):
        u * torch.ones(2, 3)
    with pytest.raises(AttributeError, match=r"Unreduced has no attribute 'sum': it is 'T F' unreduced over \{t\}"):
        u.sum()
    with pytest.raises(UnreducedError, match=r"operand 0 is 'T F' unreduced over \{t\} and operand 1 is 'T F' unreduced"):
        einsum_unreduced("T F, T F -> F", u, u)
    with pytest.raises(UnreducedError, match=r"operand 1 'F G/t' is sharded over \['t'\]: each rank would weigh"):
        einsum_unreduced("T F, F G/t -> T G/t", u, w.T)
    with pytest.raises(AttributeError, match=r"no attribute 'contiguous': it is 'T F' unreduced over \{t\}") as caught:
        u.contiguous()
    assert isinstance(caught.value, UnreducedError) and not hasattr(u, "contiguous")
    with pytest.raises(UnreducedError, match="all_gather 'T F -> T F' got 'T F' unreduced"):
        all_gather("T F -> T F", u, Mesh())
    with pytest.raises(UnreducedError, match=r"psum_scatter 'T F -> T F/d' sums over \['d'\], but its input is 'T F' unreduced over \{t\}"):
        psum_scatter("T F -> T F/d", u, Mesh())
    with pytest.raises(UnreducedError, match="already reduced there"):
        psum("T F -> T F", u, Mesh(), axes=("t", "e"))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x: all_gather("B/d L M/t -> B/d L M/t", x, m), "input and output layouts are the same"),
        (lambda m, x: all_gather("B L M -> B L M/t", x, m), r"dim M -> M/t adds axes t, which all_gather does not do"),
        (lambda m, x: psum_scatter("B L M/t -> B L M", x, m), "removes axes t, which psum_scatter does not do"),
        (lambda m, x: all_gather("B L M/t/d -> B L M/d", x, m), r"dim M/t/d -> M/d is not a gather or a split"),
        (lambda m, x: all_gather("B L M/t -> B M L", x, m), r"the output must keep the input's dims in order \(B L M\)"),
        (lambda m, x: all_gather("B M/t -> B M", x, m), r"spec 'B M/t' has 2 dims but the tensor has 3"),
        (lambda m, x: all_gather("B L, M -> B L M", x, m), "takes one input spec, got 2"),
        (lambda m, x: all_gather("B L M/t -> B L M", x, {"t": 1}), "mesh must be a shardmoe.Mesh or None, got dict"),
        (lambda m, x: all_to_all("B/d L/t M -> B L M/t", x, m), "exactly one dim must give up mesh axes"),
        (lambda m, x: psum("B L M -> B L M", x, m), "axes is required for a plain tensor"),
        (lambda m, x: psum("B L M/t -> B L M/t", x, m, axes="t"), r"cannot sum over 't', which shards dim M"),
        (lambda m, x: psum("B L M -> B L M", x, m, axes="q"), "unknown mesh axis 'q'"),
        (lambda m, x: psum("B L M -> B/d L M", x, m, axes="t"), "input and output specs must be the same"),
        (lambda m, x: identity_psum_grad("B L M -> B L M", x, m, axes=()), "axes is empty"),
        (lambda m, x: einsum_unreduced("B L M, M F -> B L F", x), "names 2 operands but got 1"),
        (lambda m, x: einsum_unreduced("B L M/t, M F -> B L F", x, torch.ones(4, 2)), r"dim M is sharded M/t in operand 0 but M in operand 1"),
        (lambda m, x: einsum_unreduced("B L M, M F -> B L F", x, torch.ones(5, 2)), "dim M has local size 4 in operand 0 but 5 in operand 1"),
        (lambda m, x: einsum_unreduced("B L M, M F/t -> B L F", x, torch.ones(4, 2)), r"output dim F must keep its operand sharding F/t"),
        (lambda m, x: einsum_unreduced("B L M -> B Q", x), "output dim Q appears in no operand"),
    ],
)
def test_argument_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(Mesh(), torch.zeros(2, 3, 4))


# -- the 4-rank world -----------------------------------------------------------------------------


def _plain(spec: str) -> str:
    """'B/d L M/t' -> 'B L M': the global layout of the same dims."""
    return " ".join(d.name for d in parse_spec(spec).dims)


def _block(spec: str, global_tensor, mesh, rank):
    return shard(f"{_plain(spec)} -> {spec}", global_tensor, mesh, rank)


def _err(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


class _Seeded:
    """The same random global tensors on every rank."""

    def __init__(self, seed):
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, *shape):
        return torch.randn(*shape, generator=self.gen, dtype=F64)


def _check_layout_change(op, spec, global_shape, mesh, rand):
    """all_gather / all_to_all: local block of X in, local block of X out.

    The loss is sum_r <out_r, G_r> / R, where R is the number of ranks holding the same input block
    (the size of the axes the input is replicated over): those ranks hold one variable, and each of
    them must end up with its whole gradient.
    """
    source, target = (s.strip() for s in spec.split("->"))
    replicas = mesh.size([a for a in "det" if a not in parse_spec(source).axes])
    X = rand(*global_shape)
    G = rand(*global_shape)  # the rank's weights are its block of G: distinct per rank where out differs
    x = _block(source, X, mesh, None).clone().requires_grad_()
    out = op(spec, x, mesh)
    (out * _block(target, G, mesh, None)).sum().backward()
    Xr = X.clone().requires_grad_()
    ranks = range(mesh.world_size)
    (sum((_block(target, Xr, mesh, r) * _block(target, G, mesh, r)).sum() for r in ranks) / replicas).backward()
    return {"forward": _err(out, _block(target, X, mesh, None)), "backward": _err(x.grad, _block(source, Xr.grad, mesh, None))}


def _check_psum_scatter(spec, local_shape, mesh, rand):
    """Every rank holds a partial P[r]; out_r = its block of the sum over the scattered axes."""
    tr_axes = parse_spec(spec.split("->")[1]).axes - parse_spec(spec.split("->")[0]).axes
    axes = tuple(a for a in "det" if a in tr_axes)
    P = rand(mesh.world_size, *local_shape)
    p = P[mesh.rank].clone().requires_grad_()
    out = psum_scatter(spec, p, mesh)
    grad_weight = rand(mesh.world_size, *out.shape)
    (out * grad_weight[mesh.rank]).sum().backward()

    def reference(P, r):
        return shard(spec, sum(P[g] for g in mesh.ranks_along(axes, r)), mesh, r)

    Pr = P.clone().requires_grad_()
    sum((reference(Pr, r) * grad_weight[r]).sum() for r in range(mesh.world_size)).backward()
    return {"forward": _err(out, reference(P, mesh.rank)), "backward": _err(p.grad, Pr.grad[mesh.rank])}


def _check_psum(axes, local_shape, mesh, rand):
    """out = sum of the partials over the group; the loss on the replicated out counts once per group."""
    P = rand(mesh.world_size, *local_shape)
    W = rand(mesh.world_size, *local_shape)
    p = P[mesh.rank].clone().requires_grad_()
    spec = " ".join(f"D{i}" for i in range(len(local_shape)))
    out = psum(f"{spec} -> {spec}", p, mesh, axes=axes)
    n = mesh.size(axes)

    def group(r):
        return mesh.ranks_along(axes, r)

    (out * W[group(mesh.rank)[0]]).sum().backward()
    Pr = P.clone().requires_grad_()
    sum((sum(Pr[g] for g in group(r)) * W[group(r)[0]]).sum() / n for r in range(mesh.world_size)).backward()
    return {
        "forward": _err(out, sum(P[g] for g in group(mesh.rank))),
        "backward": _err(p.grad, Pr.grad[mesh.rank]),
    }


def _check_identity_psum_grad(axes, local_shape, mesh, rand):
    """x is replicated over the group (one variable per group); each rank weighs it differently."""
    X = rand(mesh.world_size, *local_shape)
    W = rand(mesh.world_size, *local_shape)
    first = mesh.ranks_along(axes, mesh.rank)[0]
    x = X[first].clone().requires_grad_()
    spec = " ".join(f"D{i}" for i in range(len(local_shape)))
    out = identity_psum_grad(f"{spec} -> {spec}", x, mesh, axes=axes)
    (out * W[mesh.rank]).sum().backward()
    Xr = X.clone().requires_grad_()
    sum((Xr[mesh.ranks_along(axes, r)[0]] * W[r]).sum() for r in range(mesh.world_size)).backward()
    return {"forward": _err(out, X[first]), "backward": _err(x.grad, Xr.grad[first])}


def _check_fsdp_megatron_ffn(mesh, rand):
    """seqax pattern: all_gather -> local einsums -> psum_scatter; tokens over (d, e), weights FSDP over (d, e)."""
    B, L, M, F = 8, 3, 8, 12
    X, W1, W2, G = rand(B, L, M), rand(M, F), rand(F, M), rand(B, L, M)
    x = shard("B L M -> B/d/e L M/t", X, mesh).clone().requires_grad_()
    w1 = shard("M F -> M/d/e F/t", W1, mesh).clone().requires_grad_()
    w2 = shard("F M -> F/t M/d/e", W2, mesh).clone().requires_grad_()
    gx = all_gather("B/d/e L M/t -> B/d/e L M", x, mesh)
    h = einsum_unreduced("B/d/e L M, M F/t -> B/d/e L F/t", gx, all_gather("M/d/e F/t -> M F/t", w1, mesh))
    a = torch.tanh(h)
    z = einsum_unreduced("B/d/e L F/t, F/t M -> B/d/e L M", a, all_gather("F/t M/d/e -> F/t M", w2, mesh))
    y = psum_scatter("B/d/e L M -> B/d/e L M/t", z, mesh)
    g = shard("B L M -> B/d/e L M/t", G, mesh)
    (y * g).sum().backward()
    # The explicit weight gradient, seqax style: contracting the token dims leaves it unreduced over (d, e).
    ga = all_gather("B/d/e L M/t -> B/d/e L M", g, mesh)
    grad_a = torch.einsum("blm,fm->blf", ga, all_gather("F/t M/d/e -> F/t M", w2, mesh))
    grad_h = grad_a * (1 - a.detach() ** 2)
    grad_w1 = einsum_unreduced("B/d/e L M, B/d/e L F/t -> M F/t", gx.detach(), grad_h.detach())
    grad_w1 = psum_scatter("M F/t -> M/d/e F/t", grad_w1, mesh)

    Xr, W1r, W2r = (t.clone().requires_grad_() for t in (X, W1, W2))
    Y = torch.tanh(Xr @ W1r) @ W2r
    (Y * G).sum().backward()
    return {
        "forward": _err(y, shard("B L M -> B/d/e L M/t", Y.detach(), mesh)),
        "grad_x": _err(x.grad, shard("B L M -> B/d/e L M/t", Xr.grad, mesh)),
        "grad_w1": _err(w1.grad, shard("M F -> M/d/e F/t", W1r.grad, mesh)),
        "grad_w2": _err(w2.grad, shard("F M -> F/t M/d/e", W2r.grad, mesh)),
        "explicit_grad_w1": _err(grad_w1, w1.grad),
    }


def _check_expert_tp_ffn(mesh, rand):
    """Expert tensor parallelism's pattern (docs/parallel.md): replicated x -> identity_psum_grad ->
    column/row-parallel weights -> psum."""
    B, L, M, F = 8, 3, 4, 8
    X, W1, W2, G = rand(B, L, M), rand(M, F), rand(F, M), rand(B, L, M)
    x = shard("B L M -> B/d/e L M", X, mesh).clone().requires_grad_()
    w1 = shard("M F -> M F/t", W1, mesh).clone().requires_grad_()
    w2 = shard("F M -> F/t M", W2, mesh).clone().requires_grad_()
    xin = identity_psum_grad("B/d/e L M -> B/d/e L M", x, mesh, axes="t")
    a = torch.tanh(einsum_unreduced("B/d/e L M, M F/t -> B/d/e L F/t", xin, w1))
    y = psum("B/d/e L M -> B/d/e L M", einsum_unreduced("B/d/e L F/t, F/t M -> B/d/e L M", a, w2), mesh)
    (y * shard("B L M -> B/d/e L M", G, mesh)).sum().backward()
    # Replicated weights hold the gradient of this rank's tokens: sum it over the token shards.
    grad_w1 = psum("M F/t -> M F/t", w1.grad, mesh, axes=("d", "e"))
    grad_w2 = psum("F/t M -> F/t M", w2.grad, mesh, axes=("d", "e"))

    Xr, W1r, W2r = (t.clone().requires_grad_() for t in (X, W1, W2))
    Y = torch.tanh(Xr @ W1r) @ W2r
    (Y * G).sum().backward()
    return {
        "forward": _err(y, shard("B L M -> B/d/e L M", Y.detach(), mesh)),
        "grad_x": _err(x.grad, shard("B L M -> B/d/e L M", Xr.grad, mesh)),
        "grad_w1": _err(grad_w1, shard("M F -> M F/t", W1r.grad, mesh)),
        "grad_w2": _err(grad_w2, shard("F M -> F/t M", W2r.grad, mesh)),
    }


def _check_shard_blocks(mesh, rand):
    X = rand(8, 4, 8)
    c = mesh.coords()
    dp, tp = mesh.size("d"), mesh.size("t")
    b, m = 8 // dp, 8 // (tp * dp)
    j = c["t"] * dp + c["d"]  # 'M/t/d': t is the major axis
    return {
        "B/d M/t": _err(shard("B L M -> B/d L M/t", X, mesh), X[c["d"] * b : (c["d"] + 1) * b, :, c["t"] * (8 // tp) : (c["t"] + 1) * (8 // tp)]),
        "M/t/d": _err(shard("B L M -> B L M/t/d", X, mesh), X[:, :, j * m : (j + 1) * m]),
    }


def _checks(mesh):
    """name -> zero-argument check returning {sub-check: error}."""
    r = _Seeded(1234)
    layout_change = functools.partial(_check_layout_change, mesh=mesh, rand=r)
    return {
        "all_gather B/d L M/t": lambda: layout_change(all_gather, "B/d L M/t -> B/d L M", (8, 3, 8)),
        "all_gather M/t/d": lambda: layout_change(all_gather, "M/t/d -> M", (16,)),
        "all_gather M/d/t minor": lambda: layout_change(all_gather, "M/d/t -> M/d", (16,)),
        "all_gather two dims": lambda: layout_change(all_gather, "B/d/e L M/t -> B L M", (8, 2, 4)),
        "all_gather experts": lambda: layout_change(all_gather, "E/e F/t H -> E/e F H", (4, 8, 3)),
        "all_gather zero size": lambda: layout_change(all_gather, "B/d L M/t -> B/d L M", (8, 0, 4)),
        "all_to_all L to M": lambda: layout_change(all_to_all, "B/d L/t M -> B/d L M/t", (4, 8, 4)),
        "all_to_all M to B": lambda: layout_change(all_to_all, "B/d L M/t -> B/d/t L M", (8, 2, 4)),
        "all_to_all axis order": lambda: layout_change(all_to_all, "L/e/t M -> L M/t/e", (8, 4)),
        "all_to_all zero size": lambda: layout_change(all_to_all, "B L/t/d/e M -> B/t/d/e L M", (0, 8, 4)),
        "psum_scatter M/t": lambda: _check_psum_scatter("B/d L M -> B/d L M/t", (2, 3, 8), mesh, r),
        "psum_scatter M/t/d": lambda: _check_psum_scatter("M -> M/t/d", (16,), mesh, r),
        "psum_scatter two dims": lambda: _check_psum_scatter("M F -> M/d/e F/t", (8, 4), mesh, r),
        "psum_scatter zero size": lambda: _check_psum_scatter("B L M -> B/e/t L M", (0, 3, 4), mesh, r),
        "psum t": lambda: _check_psum("t", (2, 3), mesh, r),
        "psum d e": lambda: _check_psum(("d", "e"), (2, 3), mesh, r),
        "psum all": lambda: _check_psum(("d", "e", "t"), (5,), mesh, r),
        "identity_psum_grad t": lambda: _check_identity_psum_grad("t", (2, 3), mesh, r),
        "identity_psum_grad d e": lambda: _check_identity_psum_grad(("d", "e"), (3,), mesh, r),
        "ffn fsdp megatron": lambda: _check_fsdp_megatron_ffn(mesh, r),
        "ffn expert tp": lambda: _check_expert_tp_ffn(mesh, r),
        "shard blocks": lambda: _check_shard_blocks(mesh, r),
    }


# -- gradcheck of each op and its dual on the global math --------------------------------------
#
# On every rank, gradcheck differentiates the same function of global tensors: global inputs (equal on
# every rank) -> this rank's blocks (_ToLocal) -> the op -> the global output (_ToGlobal). All ranks
# perturb the same element at the same time, so the finite differences are those of the global map;
# the analytical Jacobian comes from the op's dual. The adapters use torch.distributed alone and encode
# the gradient convention: a block several ranks hold carries either a *partial* gradient on each
# (summed) or the *whole* one on each (counted once). A per-rank partial sum over t is the block of a
# global tensor with a leading dim T/t whose sum over T is the value.


def _region(t, spec, mesh, rank):
    """The view of global tensor t that `rank` holds under spec."""
    for i, dim in enumerate(parse_spec(spec).dims):
        size = t.shape[i] // mesh.size(dim.axes)
        t = t.narrow(i, mesh.coord(dim.axes, rank) * size, size)
    return t


def _replica(spec, mesh, rank):
    """(index, count) of `rank` among the ranks that hold the same block under spec."""
    axes = tuple(a for a in "det" if a not in parse_spec(spec).axes)
    return mesh.coord(axes, rank), mesh.size(axes)


class _ToLocal(torch.autograd.Function):
    """Global X -> this rank's block. Backward: the blocks' gradients summed over the world; of a
    *whole* gradient only the last holder's counts (the last: _ToGlobal keeps a partial gradient on
    the first, so a dual that fails to make it whole leaves zeros here)."""

    @staticmethod
    def forward(ctx, X, spec, mesh, whole):
        ctx.args = (X.shape, spec, mesh, whole)
        return _region(X, spec, mesh, mesh.rank).clone()

    @staticmethod
    def backward(ctx, grad):
        shape, spec, mesh, whole = ctx.args
        out = grad.new_zeros(shape)
        index, count = _replica(spec, mesh, mesh.rank)
        if not whole or index == count - 1:
            _region(out, spec, mesh, mesh.rank).copy_(grad)
        dist.all_reduce(out)
        return out, None, None, None


class _ToGlobal(torch.autograd.Function):
    """This rank's block y -> the global tensor (all-gathered; a block several ranks hold is taken from
    the first). Backward: this rank's block of the gradient, on every holder if the op's output gradient
    is *whole*, on the first holder only (zeros elsewhere) if it is *partial*."""

    @staticmethod
    def forward(ctx, y, spec, mesh, whole):
        ctx.args = (spec, mesh, whole)
        parts = [torch.empty_like(y) for _ in range(mesh.world_size)]
        dist.all_gather(parts, y.contiguous())
        out = y.new_zeros(parse_spec(spec).global_shape(y.shape, mesh))
        for rank, part in enumerate(parts):
            if _replica(spec, mesh, rank)[0] == 0:
                _region(out, spec, mesh, rank).copy_(part)
        return out

    @staticmethod
    def backward(ctx, G):
        spec, mesh, whole = ctx.args
        block = _region(G, spec, mesh, mesh.rank).clone()
        if not whole and _replica(spec, mesh, mesh.rank)[0] != 0:
            block.zero_()
        return block, None, None, None


def _gradcheck_cases(mesh):
    """name -> (global input shapes, function of the global inputs). Mesh d=2, t=2."""
    def local(X, spec, whole=False):
        return _ToLocal.apply(X, spec, mesh, whole)

    def to_global(y, spec, whole=False):
        return _ToGlobal.apply(y, spec, mesh, whole)

    def einsum_psum_scatter(A, W):
        u = einsum_unreduced("B/d F/t, F/t M -> B/d M", local(A, "B/d F/t"), local(W, "F/t M"))
        return to_global(psum_scatter("B/d M -> B/d M/t", u, mesh), "B/d M/t")

    def einsum_psum(A, W, V):
        u = einsum_unreduced("B/d F/t, F/t M -> B/d M", local(A, "B/d F/t"), local(W, "F/t M"))
        u = einsum_unreduced("B/d M, M N -> B/d N", u, local(V, "M N"))  # linear in the Unreduced operand
        return to_global(psum("B/d N -> B/d N", u, mesh), "B/d N", whole=True)

    return {
        "all_gather <-> psum_scatter": ([(4, 4)], lambda X: to_global(
            all_gather("B/d M/t -> B/d M", local(X, "B/d M/t"), mesh), "B/d M")),
        "all_gather M/t/d <-> psum_scatter": ([(8,)], lambda X: to_global(
            all_gather("M/t/d -> M", local(X, "M/t/d"), mesh), "M")),
        "psum_scatter <-> all_gather": ([(2, 4, 4)], lambda X: to_global(
            psum_scatter("B/d M -> B/d M/t", local(X, "T/t B/d M")[0], mesh), "B/d M/t")),
        "psum <-> identity": ([(2, 4, 3)], lambda X: to_global(
            psum("B/d M -> B/d M", local(X, "T/t B/d M")[0], mesh, axes="t"), "B/d M", whole=True)),
        "identity_psum_grad <-> psum": ([(4, 3)], lambda X: to_global(
            identity_psum_grad("B/d M -> B/d M", local(X, "B/d M", whole=True), mesh, axes="t"), "B/d M")),
        "all_to_all <-> all_to_all": ([(2, 4, 4)], lambda X: to_global(
            all_to_all("B/d L/t M -> B/d L M/t", local(X, "B/d L/t M"), mesh), "B/d L M/t")),
        "shard": ([(4, 4)], lambda X: to_global(shard("B M -> B/d M/t", local(X, "B M"), mesh), "B/d M/t")),
        "einsum_unreduced -> psum_scatter": ([(4, 4), (4, 4)], einsum_psum_scatter),
        "einsum_unreduced -> psum": ([(4, 4), (4, 3), (3, 2)], einsum_psum),
    }


def _gradchecks(mesh, rand):
    """name -> '' when gradcheck passes, else its message (the same on every rank: the map is global).

    fast_mode compares u^T J v for random u, v instead of every column of J: a full Jacobian costs two
    forwards per input element, each with collectives. The random directions are drawn from torch's
    generator, seeded alike on every rank so that all ranks perturb the global inputs alike."""
    results = {}
    for name, (shapes, function) in _gradcheck_cases(mesh).items():
        inputs = [rand(*shape).requires_grad_() for shape in shapes]
        torch.manual_seed(0)
        try:
            gradcheck(function, inputs, eps=EPS, atol=ATOL, rtol=RTOL, fast_mode=True)
            results[name] = ""
        except GradcheckError as error:
            results[name] = str(error)
    return results


def _expect_error(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def _run_world(layouts):
    results = {}
    for layout in layouts:
        mesh = Mesh(*layout)
        for name, check in _checks(mesh).items():
            try:
                results[(layout, name)] = check()
            except Exception as error:  # recorded so the parent reports which check broke
                results[(layout, name)] = {"exception": f"{type(error).__name__}: {error}"}
    if dist.get_world_size() != 4:
        return results
    # Errors come before any communication, identically on every rank, so nobody is left waiting.
    mesh = Mesh(tp=4)
    results["uneven"] = _expect_error(lambda: psum_scatter("B L M -> B L M/t", torch.zeros(2, 3, 6), mesh))
    results["uneven all_to_all"] = _expect_error(lambda: all_to_all("B L/t M -> B L M/t", torch.zeros(2, 3, 6), mesh))
    results["gradcheck"] = _gradchecks(Mesh(dp=2, tp=2), _Seeded(99))
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def world():
    return run_distributed(_run_world, 4, args=(LAYOUTS,), timeout=120, collective_timeout=30)


@pytest.fixture(scope="module")
def world8():
    """Three axes of size 2: groups over two of them are flattened sub-meshes."""
    return run_distributed(_run_world, 8, args=([(2, 2, 2)],), timeout=120, collective_timeout=30)


@pytest.mark.parametrize("layout", LAYOUTS + [(2, 2, 2)], ids=str)
def test_ops_match_the_global_math(request, layout):
    world = request.getfixturevalue("world8" if layout == (2, 2, 2) else "world")
    failures = []
    for rank, results in enumerate(world):
        ran = [name for key, name in (k for k in results if isinstance(k, tuple)) if key == layout]
        assert sorted(ran) == sorted(_checks(Mesh())), f"rank {rank} ran {ran}"  # none passes by not running
        for (lay, name), errors in ((k, v) for k, v in results.items() if isinstance(k, tuple)):
            if lay != layout:
                continue
            for sub, err in errors.items():
                if sub == "exception" or err > TOL:
                    failures.append(f"rank {rank} {name} {sub}: {err}")
    assert not failures, "\n".join(failures)


def test_every_check_ran(world):
    keys = [key for key in world[0] if isinstance(key, tuple)]
    assert len(keys) == len(LAYOUTS) * 22


def test_uneven_splits_raise_before_communicating(world):
    for results in world:
        assert results["uneven"] == "dim M of 'B L M': local size 6 does not split evenly over t=4 = 4"
        assert results["uneven all_to_all"] == "dim M of 'B L/t M': local size 6 does not split evenly over t=4 = 4"


def test_each_op_and_its_dual_pass_gradcheck_on_the_global_math(world):
    for rank, results in enumerate(world):
        assert sorted(results["gradcheck"]) == sorted(_gradcheck_cases(Mesh())), f"rank {rank}"
        failed = {name: message for name, message in results["gradcheck"].items() if message}
        assert not failed, f"rank {rank}: {failed}"
