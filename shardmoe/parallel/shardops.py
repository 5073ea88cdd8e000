"""Collectives written as spec transitions, each differentiable through its dual.

Every op takes the spec first, then the tensor(s), then the mesh, and checks the local input shape
against the spec before it communicates::

    all_gather('B/d L M/t -> B/d L M', x, mesh)          backward: psum_scatter
    psum_scatter('B/d L M -> B/d L M/t', x, mesh)         backward: all_gather
    psum('B/d L M -> B/d L M', x, mesh, axes='t')         backward: identity
    identity_psum_grad('B/d L M -> B/d L M', x, mesh, axes='t')   forward identity, backward psum
    all_to_all('B/d L/t M -> B/d L M/t', x, mesh)         backward: the reverse all_to_all
    shard('B L M -> B/d L M/t', x, mesh)                  slice this rank's block, no communication
    einsum_unreduced('B/d L F/t, M F/t -> B/d L M', a, b) local einsum; contracting a sharded dim
                                                          gives an Unreduced result
    unreduced('N H', partial, axes='t')                   mark the partial sums of a contraction that
                                                          is not an einsum (a lookup, a grouped GEMM)

Gradient convention (the one Megatron and seqax use): the loss is a sum over token shards, and a
value replicated over an axis carries either a *whole* gradient (equal on every rank of the axis)
or a *partial* one (to be summed over the axis). all_gather expects a partial gradient for its
output over the gathered axes (its consumers use it with different tokens or different weight
shards on each rank) and makes the input's gradient whole with a psum_scatter. psum expects a whole
gradient for its output (everything downstream is replicated) and passes it through unchanged.
identity_psum_grad marks the spot where a replicated value starts feeding rank-specific work: its
gradient arrives partial and leaves whole.

Ops whose axes all have size 1 return their input unchanged (no copy, no communication);
``mesh=None`` is a single process (every axis has size 1), and Unreduced values are tracked there too.
Only even splits are supported; an uneven one raises ValueError naming the dim and the axes.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

import torch
import torch.distributed as dist

from shardmoe.mesh import Mesh
from shardmoe.notation import MESH_AXES, Spec, Transition, parse_spec, parse_transition


class UnreducedError(ValueError):
    """An Unreduced (per-rank partial sum) was used where a reduced value is needed."""


class _UnreducedAttributeError(UnreducedError, AttributeError):
    """A tensor method called on an Unreduced (an AttributeError, so hasattr and getattr's default work)."""


class Unreduced:
    """The per-rank partial sums of a value: the true value is ``sum over ranks of axes of partial``.

    einsum_unreduced returns one when it contracts a sharded dim. The only ways to consume it are
    psum / psum_scatter (which reduce it) and linear arithmetic that keeps it a partial sum:
    ``u + v`` (both unreduced over the same axes), ``-u``, ``u * c`` and ``u / c`` for a Python
    number c, ``u.to(dtype)``, and einsum_unreduced with u as its only Unreduced operand. Any other
    torch function or tensor method on it raises UnreducedError (naming the value and the op);
    ``.partial`` is the explicit escape hatch for code that reduces by itself.
    """

    __slots__ = ("partial", "axes", "spec")

    def __init__(self, partial: torch.Tensor, axes: Iterable[str], spec: Spec):
        self.partial = partial
        self.axes = frozenset(axes)
        self.spec = spec

    @property
    def shape(self) -> torch.Size:
        return self.partial.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.partial.dtype

    @property
    def device(self) -> torch.device:
        return self.partial.device

    def to(self, dtype: torch.dtype) -> Unreduced:
        """Cast the partial sums (each rounds on its own; the reduction then sums the rounded parts)."""
        return Unreduced(self.partial.to(dtype), self.axes, self.spec)

    def _describe(self) -> str:
        return f"{self.spec.text!r} unreduced over {{{', '.join(sorted(self.axes))}}}"

    def _same_kind(self, other: Unreduced, op: str) -> None:
        layout = [d.axes for d in self.spec.dims]
        if other.axes != self.axes or [d.axes for d in other.spec.dims] != layout:
            raise UnreducedError(f"cannot {op} {self._describe()} and {other._describe()}: axes or layouts differ")

    def __add__(self, other):
        if isinstance(other, Unreduced):
            self._same_kind(other, "add")
            return Unreduced(self.partial + other.partial, self.axes, self.spec)
        if isinstance(other, (int, float)) and other == 0:  # lets sum([u1, u2]) start from 0
            return self
        raise UnreducedError(
            f"cannot add {type(other).__name__} to {self._describe()}: every rank would add it once; "
            "reduce first with psum or psum_scatter"
        )

    __radd__ = __add__

    def __sub__(self, other):
        return self + (-other)

    def __rsub__(self, other):
        return (-self) + other

    def __neg__(self):
        return Unreduced(-self.partial, self.axes, self.spec)

    def __mul__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return Unreduced(self.partial * other, self.axes, self.spec)
        raise UnreducedError(
            f"cannot multiply {self._describe()} by {type(other).__name__}: only Python numbers keep a partial "
            "sum a partial sum; reduce first with psum or psum_scatter"
        )

    __rmul__ = __mul__

    def __truediv__(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return Unreduced(self.partial / other, self.axes, self.spec)
        raise UnreducedError(f"cannot divide {self._describe()} by {type(other).__name__}; reduce it first")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        values = (*args, *(kwargs or {}).values())
        found = [a for a in values if isinstance(a, Unreduced)]
        found += [a for v in values if isinstance(v, (list, tuple)) for a in v if isinstance(a, Unreduced)]
        which = f", {found[0]._describe()}" if found else ""
        raise UnreducedError(
            f"{name} got an Unreduced value (a per-rank partial sum){which}; reduce it with psum or psum_scatter "
            "first, or take .partial explicitly"
        )

    def __getattr__(self, name):
        raise _UnreducedAttributeError(
            f"Unreduced has no attribute {name!r}: it is {self._describe()}; reduce it with psum or "
            "psum_scatter first, or take .partial explicitly"
        )

    def __repr__(self) -> str:
        return f"Unreduced({self._describe()}, local shape {tuple(self.partial.shape)})"


# -- public ops --------------------------------------------------------------------------------


def all_gather(spec: str, x: torch.Tensor, mesh: Mesh | None) -> torch.Tensor:
    """Gather the blocks of the dims whose axes the output drops: 'B/d L M/t -> B/d L M'.

    Forward: out[..., M, ...] = concat over t of x_t (block order = coord of the dropped axes).
    Backward: psum_scatter of the output gradient (it is partial over the gathered axes).
    """
    tr, x = _prepare("all_gather", spec, x, mesh, accepts_unreduced=False)
    for dim, _, axes in _plan("all_gather", tr, allowed=("gather",)):
        x = _apply(_Gather, x, dim, axes, mesh)
    return x


def psum_scatter(spec: str, x: torch.Tensor | Unreduced, mesh: Mesh | None) -> torch.Tensor | Unreduced:
    """Sum over the axes the output adds and keep this rank's block: 'B/d L M -> B/d L M/t'.

    Forward: out = block_t(sum over t of x). x may be Unreduced over (at least) the added axes, or
    a plain tensor holding this rank's partial sum. Axes it stays unreduced over carry through.
    Backward: all_gather of the output gradient.
    """
    tr, x = _prepare("psum_scatter", spec, x, mesh, accepts_unreduced=True)
    steps = _plan("psum_scatter", tr, allowed=("scatter",))
    added = frozenset(a for _, _, axes in steps for a in axes)
    partial, remaining = _take_reduction(x, added, "psum_scatter", tr.text)
    for dim, _, axes in steps:  # check every split before the first collective
        _check_even(tr.inputs[0], partial.shape, dim, axes, mesh)
    for dim, _, axes in steps:
        partial = _apply(_ReduceScatter, partial, dim, axes, mesh)
    return Unreduced(partial, remaining, tr.output) if remaining else partial


def psum(spec: str, x: torch.Tensor | Unreduced, mesh: Mesh | None, axes: str | Iterable[str] | None = None):
    """Sum over ranks along ``axes``; the layout does not change: 'B/d L M -> B/d L M'.

    For an Unreduced x, ``axes`` defaults to all the axes it is unreduced over (a subset leaves it
    unreduced over the rest). For a plain tensor (a per-rank partial sum) ``axes`` is required.
    Backward: identity (the output is replicated over ``axes`` and so is its gradient).
    """
    tr, x = _prepare("psum", spec, x, mesh, accepts_unreduced=True)
    if axes is None:
        if not isinstance(x, Unreduced):
            raise ValueError(f"psum {tr.text!r}: axes is required for a plain tensor (which axes to sum over?)")
        axes = tuple(a for a in MESH_AXES if a in x.axes)
    axes = _reduction_axes("psum", tr, axes)
    partial, remaining = _take_reduction(x, frozenset(axes), "psum", tr.text)
    out = _apply(_AllReduce, partial, None, axes, mesh)
    return Unreduced(out, remaining, tr.output) if remaining else out


def identity_psum_grad(spec: str, x: torch.Tensor, mesh: Mesh | None, axes: str | Iterable[str]) -> torch.Tensor:
    """Identity forward, psum over ``axes`` backward: 'B/d L M -> B/d L M'.

    Put it where a value replicated over ``axes`` enters work that differs per rank (the input of
    column-parallel expert weights under expert tensor parallelism, docs/parallel.md): each rank's
    gradient is then partial over ``axes``.
    """
    tr, x = _prepare("identity_psum_grad", spec, x, mesh, accepts_unreduced=False)
    axes = _reduction_axes("identity_psum_grad", tr, axes)
    return _apply(_IdentityAllReduceGrad, x, None, axes, mesh)


def all_to_all(spec: str, x: torch.Tensor, mesh: Mesh | None) -> torch.Tensor:
    """Move sharding axes from one dim to another: 'B/d L/t M -> B/d L M/t'.

    Forward: each rank sends block j of the newly split dim to the rank at coord j and concatenates
    the blocks it receives along the dim that loses the axes. Backward: the reverse all_to_all.
    """
    tr, x = _prepare("all_to_all", spec, x, mesh, accepts_unreduced=False)
    steps = _plan("all_to_all", tr, allowed=("gather", "scatter"))
    gathers = [s for s in steps if s[1] == "gather"]
    scatters = [s for s in steps if s[1] == "scatter"]
    if len(gathers) != 1 or len(scatters) != 1 or set(gathers[0][2]) != set(scatters[0][2]):
        raise ValueError(
            f"all_to_all {tr.text!r}: exactly one dim must give up mesh axes and exactly one other dim must "
            "take the same axes"
        )
    (concat_dim, _, from_axes), (split_dim, _, to_axes) = gathers[0], scatters[0]
    _check_even(tr.inputs[0], x.shape, split_dim, to_axes, mesh)
    if _size(mesh, from_axes) == 1:
        return x
    return _AllToAll.apply(x, split_dim, to_axes, concat_dim, from_axes, mesh)


def shard(spec: str, x: torch.Tensor, mesh: Mesh | None, rank: int | None = None) -> torch.Tensor:
    """This rank's (or ``rank``'s) block of a replicated tensor: 'B L M -> B/d L M/t'. No communication.

    Backward: the gradient is zero outside the block, i.e. partial over the sharding axes.
    """
    tr, x = _prepare("shard", spec, x, mesh, accepts_unreduced=False)
    for dim, _, axes in _plan("shard", tr, allowed=("scatter",), allow_noop=True):
        _check_even(tr.inputs[0], x.shape, dim, axes, mesh)
        if _size(mesh, axes) == 1:
            continue
        size = x.shape[dim] // mesh.size(axes)
        x = x.narrow(dim, mesh.coord(axes, rank) * size, size)
    return x


def einsum_unreduced(spec: str, *operands: torch.Tensor | Unreduced) -> torch.Tensor | Unreduced:
    """Local einsum on the shards: 'B/d L M, M F/t -> B/d L F/t'. No communication.

    A dim shared by several operands must have the same sharding in each; output dims keep their
    input sharding. Contracting a dim sharded over some axes gives an Unreduced result over those
    axes (seqax's {U_t}); otherwise a plain tensor.

    An einsum is linear in each operand, so one operand may itself be Unreduced over axes A (a
    partial-sum gradient, say) as long as no other operand is sharded over A (then every rank
    multiplies its partial by the same values): the result is Unreduced over A as well.
    """
    tr = parse_transition(spec)
    if len(tr.inputs) != len(operands):
        raise ValueError(f"einsum_unreduced {tr.text!r} names {len(tr.inputs)} operands but got {len(operands)}")
    carried = _carried_unreduced(tr, operands)
    operands = tuple(x.partial if isinstance(x, Unreduced) else x for x in operands)
    seen: dict[str, tuple[tuple[str, ...], int, int]] = {}  # name -> (axes, local size, operand index)
    for i, (in_spec, x) in enumerate(zip(tr.inputs, operands)):
        _check_local(f"einsum_unreduced operand {i}", in_spec, x)
        for dim, size in zip(in_spec.dims, x.shape):
            if dim.name not in seen:
                seen[dim.name] = (dim.axes, size, i)
                continue
            axes, first_size, j = seen[dim.name]
            if axes != dim.axes:
                raise ValueError(
                    f"einsum_unreduced {tr.text!r}: dim {dim.name} is sharded {'/'.join((dim.name, *axes))} in "
                    f"operand {j} but {dim} in operand {i}"
                )
            if size != first_size:
                raise ValueError(
                    f"einsum_unreduced {tr.text!r}: dim {dim.name} has local size {first_size} in operand {j} "
                    f"but {size} in operand {i}"
                )
    for dim in tr.output.dims:
        if dim.name not in seen:
            raise ValueError(f"einsum_unreduced {tr.text!r}: output dim {dim.name} appears in no operand")
        if seen[dim.name][0] != dim.axes:
            raise ValueError(
                f"einsum_unreduced {tr.text!r}: output dim {dim} must keep its operand sharding "
                f"{'/'.join((dim.name, *seen[dim.name][0]))}; change sharding with all_gather or psum_scatter"
            )
    letters = dict(zip(seen, string.ascii_letters))
    if len(letters) < len(seen):
        raise ValueError(f"einsum_unreduced {tr.text!r}: more than {len(letters)} distinct dims")
    equation = ",".join("".join(letters[n] for n in s.names) for s in tr.inputs)
    equation += "->" + "".join(letters[n] for n in tr.output.names)
    out = torch.einsum(equation, *operands)
    contracted = set(seen) - set(tr.output.names)
    axes = carried | frozenset(a for name in contracted for a in seen[name][0])
    return Unreduced(out, axes, tr.output) if axes else out


def _carried_unreduced(tr: Transition, operands) -> frozenset[str]:
    """The axes an Unreduced operand of einsum_unreduced passes on to its result (see there)."""
    unreduced_at = [i for i, x in enumerate(operands) if isinstance(x, Unreduced)]
    if not unreduced_at:
        return frozenset()
    if len(unreduced_at) > 1:
        described = " and ".join(f"operand {i} is {operands[i]._describe()}" for i in unreduced_at)
        raise UnreducedError(
            f"einsum_unreduced {tr.text!r}: {described}; a product of two partial sums is not a partial sum of "
            "the product: reduce all but one first"
        )
    (i,) = unreduced_at
    u = operands[i]
    if [d.axes for d in u.spec.dims] != [d.axes for d in tr.inputs[i].dims]:
        raise ValueError(f"einsum_unreduced {tr.text!r}: operand {i} is {u._describe()}, whose layout differs from "
                         f"{tr.inputs[i].text!r}")
    for j, other in enumerate(tr.inputs):
        if j != i and other.axes & u.axes:
            raise UnreducedError(
                f"einsum_unreduced {tr.text!r}: operand {i} is {u._describe()}, but operand {j} {other.text!r} is "
                f"sharded over {sorted(other.axes & u.axes)}: each rank would weigh its partial by a different "
                "block; reduce it first"
            )
    return u.axes


def unreduced(spec: str, partial: torch.Tensor, axes: str | Iterable[str]) -> Unreduced:
    """Mark ``partial`` as this rank's term of a sum over ``axes``: 'N H' unreduced over {t}.

    For contractions over a sharded dim that are not einsums (a row lookup in a vocab block, an
    index_add over this rank's tokens, a grouped expert GEMM over F/t) and for gradients that
    arrive partial by the gradient convention. No copy: the result wraps the same tensor and must
    go through psum or psum_scatter like einsum_unreduced's. The spec must not shard a dim over
    ``axes`` (its ranks hold different blocks, not terms of one sum).
    """
    parsed = parse_spec(spec)
    axes = frozenset((axes,) if isinstance(axes, str) else axes)
    if not axes:
        raise ValueError(f"unreduced {spec!r}: axes is empty")
    unknown = sorted(axes - set(MESH_AXES))
    if unknown:
        raise ValueError(f"unreduced {spec!r}: unknown mesh axes {unknown} in axes; known axes: {', '.join(MESH_AXES)}")
    if parsed.axes & axes:
        raise ValueError(f"unreduced {spec!r}: axes {sorted(parsed.axes & axes)} shard a dim of the spec, so its ranks "
                         "hold different blocks, not terms of one sum")
    _check_local("unreduced", parsed, partial)
    return Unreduced(partial, axes, parsed)


# -- planning and checks -----------------------------------------------------------------------


def _prepare(op: str, spec: str, x, mesh: Mesh | None, accepts_unreduced: bool) -> tuple[Transition, torch.Tensor | Unreduced]:
    tr = parse_transition(spec)
    if len(tr.inputs) != 1:
        raise ValueError(f"{op} {tr.text!r}: takes one input spec, got {len(tr.inputs)}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise ValueError(f"{op} {tr.text!r}: mesh must be a shardmoe.Mesh or None, got {type(mesh).__name__}")
    (source,) = tr.inputs
    if source.names != tr.output.names:
        raise ValueError(
            f"{op} {tr.text!r}: the output must keep the input's dims in order ({' '.join(source.names)}), "
            f"got {' '.join(tr.output.names)}"
        )
    if isinstance(x, Unreduced):
        if not accepts_unreduced:
            raise UnreducedError(f"{op} {tr.text!r} got {x._describe()}; reduce it with psum or psum_scatter first")
        if [d.axes for d in x.spec.dims] != [d.axes for d in source.dims]:
            raise ValueError(f"{op} {tr.text!r}: input is {x._describe()}, whose layout differs from {source.text!r}")
        _check_local(op, source, x.partial)
    else:
        _check_local(op, source, x)
    return tr, x


def _check_local(op: str, spec: Spec, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{op} {spec.text!r}: expected a torch.Tensor, got {type(x).__name__}")
    # Numeric dims and the number of dims are all a local shape can be checked against on its own;
    # sizes along sharding axes are checked where a collective splits a dim (_check_even).
    spec.check(x.shape, dict.fromkeys(MESH_AXES, 1))


def _plan(op: str, tr: Transition, allowed: tuple[str, ...], allow_noop=False) -> list[tuple[int, str, tuple]]:
    """Per-dim steps (dim index, 'gather' | 'scatter', axes) that turn the input layout into the output."""
    steps = []
    for i, (a, b) in enumerate(zip(tr.inputs[0].dims, tr.output.dims)):
        if a.axes == b.axes:
            continue
        # Axes come and go on the minor (right) side only: that keeps every step a plain split or
        # concatenation of the local block.
        if b.axes[: len(a.axes)] == a.axes:
            step = (i, "scatter", b.axes[len(a.axes) :])
        elif a.axes[: len(b.axes)] == b.axes:
            step = (i, "gather", a.axes[len(b.axes) :])
        else:
            raise ValueError(
                f"{op} {tr.text!r}: dim {a} -> {b} is not a gather or a split; axes are added or removed "
                "at the end of a dim's axis list"
            )
        if step[1] not in allowed:
            verb = {"gather": "removes", "scatter": "adds"}[step[1]]
            raise ValueError(
                f"{op} {tr.text!r}: dim {a} -> {b} {verb} axes {', '.join(step[2])}, which {op} does not do"
            )
        steps.append(step)
    if not steps and not allow_noop:
        raise ValueError(f"{op} {tr.text!r}: input and output layouts are the same; nothing to do")
    return steps


def _reduction_axes(op: str, tr: Transition, axes) -> tuple[str, ...]:
    if tr.inputs[0].dims != tr.output.dims:
        raise ValueError(f"{op} {tr.text!r}: input and output specs must be the same")
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if not axes:
        raise ValueError(f"{op} {tr.text!r}: axes is empty")
    for a in axes:
        if a not in MESH_AXES:
            raise ValueError(f"{op} {tr.text!r}: unknown mesh axis {a!r} in axes; known axes: {', '.join(MESH_AXES)}")
        for dim in tr.output.dims:
            if a in dim.axes:
                raise ValueError(
                    f"{op} {tr.text!r}: cannot sum over {a!r}, which shards dim {dim.name}: its ranks hold "
                    "different blocks"
                )
    return axes


def _take_reduction(x, axes: frozenset[str], op: str, text: str) -> tuple[torch.Tensor, frozenset[str]]:
    """Split x into the tensor to reduce and the axes it stays unreduced over afterwards."""
    if not isinstance(x, Unreduced):
        return x, frozenset()
    extra = axes - x.axes
    if extra:
        raise UnreducedError(
            f"{op} {text!r} sums over {sorted(extra)}, but its input is {x._describe()}: it is already reduced "
            "there and the sum would count it once per rank"
        )
    return x.partial, x.axes - axes


def _size(mesh: Mesh | None, axes) -> int:
    """Number of ranks along ``axes``; 1 for mesh=None (a single process)."""
    return 1 if mesh is None else mesh.size(axes)


def _check_even(spec: Spec, shape, dim: int, axes: tuple[str, ...], mesh: Mesh | None) -> None:
    n = _size(mesh, axes)
    if shape[dim] % n:
        sizes = "*".join(f"{a}={_size(mesh, a)}" for a in axes)
        raise ValueError(
            f"dim {spec.dims[dim].name} of {spec.text!r}: local size {shape[dim]} does not split evenly over "
            f"{sizes} = {n}"
        )


def _apply(fn, x: torch.Tensor, dim, axes: tuple[str, ...], mesh: Mesh | None) -> torch.Tensor:
    # A group of one rank needs no communication, and then neither does the dual.
    if _size(mesh, axes) == 1:
        return x
    return fn.apply(x, dim, axes, mesh)


# -- communication (no autograd) ---------------------------------------------------------------


def _members(mesh: Mesh, axes: tuple[str, ...]) -> tuple[dist.ProcessGroup, list[int]]:
    """The group over ``axes`` and, for each group rank, the block index it holds (coord(axes))."""
    group = mesh.group(axes)
    blocks = [mesh.coord(axes, r) for r in dist.get_process_group_ranks(group)]
    return group, blocks


def _gather(x: torch.Tensor, dim: int, axes, mesh: Mesh) -> torch.Tensor:
    group, blocks = _members(mesh, axes)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in blocks]
    dist.all_gather(parts, x, group=group)
    ordered = [parts[g] for g in sorted(range(len(blocks)), key=blocks.__getitem__)]
    return torch.cat(ordered, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, axes, mesh: Mesh) -> torch.Tensor:
    group, blocks = _members(mesh, axes)
    chunks = x.tensor_split(len(blocks), dim)
    out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
    dist.reduce_scatter(out, [chunks[b].contiguous() for b in blocks], group=group)
    return out


def _all_reduce(x: torch.Tensor, axes, mesh: Mesh) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=mesh.group(axes))
    return out


def _exchange(x: torch.Tensor, split_dim: int, to_axes, concat_dim: int, from_axes, mesh: Mesh) -> torch.Tensor:
    group = mesh.group(to_axes)  # same set of axes as from_axes, so the same group
    ranks = dist.get_process_group_ranks(group)
    chunks = x.tensor_split(len(ranks), split_dim)
    sends = [chunks[mesh.coord(to_axes, r)].contiguous() for r in ranks]
    received = [torch.empty_like(s) for s in sends]
    dist.all_to_all(received, sends, group=group)
    order = sorted(range(len(ranks)), key=lambda g: mesh.coord(from_axes, ranks[g]))
    return torch.cat([received[g] for g in order], concat_dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axes, mesh):
        ctx.args = (dim, axes, mesh)
        return _gather(x, dim, axes, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, *ctx.args), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axes, mesh):
        ctx.args = (dim, axes, mesh)
        return _reduce_scatter(x, dim, axes, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, *ctx.args), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axes, mesh):
        return _all_reduce(x, axes, mesh)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _IdentityAllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axes, mesh):
        ctx.args = (axes, mesh)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, *ctx.args), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, to_axes, concat_dim, from_axes, mesh):
        ctx.args = (split_dim, to_axes, concat_dim, from_axes, mesh)
        return _exchange(x, split_dim, to_axes, concat_dim, from_axes, mesh)

    @staticmethod
    def backward(ctx, grad):
        split_dim, to_axes, concat_dim, from_axes, mesh = ctx.args
        return _exchange(grad, concat_dim, from_axes, split_dim, to_axes, mesh), None, None, None, None, None
