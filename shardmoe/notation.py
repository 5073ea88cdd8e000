"""Named-axis shape specs: which dims of a tensor are split over which mesh axes.

A spec is a space-separated list of dims, each ``name[/axis]*``::

    'B/d L M/t'      B split over mesh axis d, L whole, M split over t
    'M/t/d'          M split over t and d together; t is the major axis (see below)
    '2 M/d'          a dim whose name is a number has that fixed size

Mesh axes are ``d`` (data / FSDP), ``e`` (expert) and ``t`` (tensor). A tensor described by a spec
holds, on each rank, the local shard: a dim split over axes (a1, a2, ...) has local size
``global / (|a1| * |a2| * ...)`` and this rank holds block number
``((c1 * |a2|) + c2) * |a3| + ...`` where ci is the rank's coordinate on ai: the first listed axis
varies slowest. An axis shards at most one dim of a spec.

A transition ``'B/d L M/t -> B/d L M'`` names the input spec(s) (comma-separated) and the output
spec of a collective or an einsum. Parsing is cached (``functools.lru_cache``), so writing specs
inline in hot code costs one dict lookup.

Sizes of mesh axes come from any mapping ``{'d': 2, 'e': 1, 't': 2}`` or from an object with an
``axis_sizes`` attribute (``shardmoe.Mesh``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MESH_AXES = ("d", "e", "t")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")


@dataclass(frozen=True)
class Dim:
    """One dim of a spec: its name and the mesh axes that split it, major first."""

    name: str
    axes: tuple[str, ...] = ()

    @property
    def fixed_size(self) -> int | None:
        """The size a numeric name pins ('2' -> 2), else None."""
        return int(self.name) if self.name.isdigit() else None

    def shards(self, axis_sizes: Mapping[str, int]) -> int:
        """Number of blocks the dim is cut into: the product of its axes' sizes."""
        return math.prod(axis_sizes[a] for a in self.axes)

    def __str__(self) -> str:
        return "/".join((self.name, *self.axes))


@dataclass(frozen=True)
class Spec:
    """A parsed shape spec: its source text and its dims in order."""

    text: str
    dims: tuple[Dim, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def axes(self) -> frozenset[str]:
        """Every mesh axis that shards some dim."""
        return frozenset(a for d in self.dims for a in d.axes)

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"spec {self.text!r} has no dim {name!r}; its dims are {', '.join(self.names)}") from None

    def local_shape(self, global_shape: Sequence[int] | Mapping[str, int], axis_sizes) -> tuple[int, ...]:
        """Local (per-rank) shape from global sizes, given positionally or by dim name.

        Raises ValueError when a sharded dim does not split evenly over its axes.
        """
        sizes = _axis_sizes(axis_sizes, self)
        shape = self._by_position(global_shape, "global_shape")
        local = []
        for dim, size in zip(self.dims, shape):
            shards = dim.shards(sizes)
            if size % shards:
                raise ValueError(
                    f"dim {dim.name} of {self.text!r}: global size {size} does not split evenly over "
                    f"{_axes_text(dim.axes, sizes)} = {shards}"
                )
            local.append(size // shards)
        return tuple(local)

    def global_shape(self, local_shape: Sequence[int], axis_sizes) -> tuple[int, ...]:
        """Global shape from a local shape: each sharded dim multiplied by its shard count."""
        sizes = _axis_sizes(axis_sizes, self)
        shape = self._by_position(local_shape, "local_shape")
        return tuple(size * dim.shards(sizes) for dim, size in zip(self.dims, shape))

    def check(self, local_shape: Sequence[int], axis_sizes, global_sizes: Mapping[str, int] | None = None) -> None:
        """Check a local shape against the spec, the mesh and (optionally) known global sizes.

        Checks the number of dims, numeric dims' fixed sizes, and for each name in ``global_sizes``
        that ``local == global / shards``. Raises ValueError naming the dim, the axes and both sizes.
        """
        sizes = _axis_sizes(axis_sizes, self)
        shape = tuple(local_shape)
        if len(shape) != self.ndim:
            raise ValueError(f"spec {self.text!r} has {self.ndim} dims but the tensor has {len(shape)}: shape {shape}")
        global_sizes = dict(global_sizes or {})
        unknown = set(global_sizes) - set(self.names)
        if unknown:
            raise ValueError(f"global_sizes names {sorted(unknown)} that are not dims of {self.text!r}")
        for dim, local in zip(self.dims, shape):
            if dim.fixed_size is not None:
                global_sizes.setdefault(dim.name, dim.fixed_size)
            if dim.name not in global_sizes:
                continue
            size = global_sizes[dim.name]
            shards = dim.shards(sizes)
            if local * shards != size:
                if dim.axes:
                    expected = f"global {size} / {_axes_text(dim.axes, sizes)} = {size / shards:g}"
                else:
                    expected = f"global {size} (dim not sharded)"
                raise ValueError(f"dim {dim.name} of {self.text!r}: local size {local} is not {expected}")

    def _by_position(self, shape, argument: str) -> tuple[int, ...]:
        if isinstance(shape, Mapping):
            missing = [n for n in self.names if n not in shape]
            if missing:
                raise ValueError(f"{argument} lacks sizes for dims {missing} of {self.text!r}")
            return tuple(shape[n] for n in self.names)
        shape = tuple(shape)
        if len(shape) != self.ndim:
            raise ValueError(f"{argument} has {len(shape)} sizes but spec {self.text!r} has {self.ndim} dims")
        return shape

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Transition:
    """A parsed 'inputs -> output' spec, e.g. 'B/d L F/t, M F/t -> B/d L M'."""

    text: str
    inputs: tuple[Spec, ...]
    output: Spec


@functools.lru_cache(maxsize=4096)
def parse_spec(text: str) -> Spec:
    """Parse 'B/d L M/t' into a Spec. Cached: equal texts give the same object.

    Raises ValueError for an empty spec, an empty or malformed dim name, an empty or unknown axis,
    a dim named twice, an axis used twice, and an axis on a numeric dim.
    """
    if not isinstance(text, str):
        raise ValueError(f"a shape spec is a str like 'B/d L M/t', got {type(text).__name__}")
    fields = text.split()
    if not fields:
        raise ValueError(f"empty shape spec {text!r}: write dims like 'B/d L M/t' (a scalar is the dim '1')")
    dims = []
    owner = {}  # axis -> name of the dim it shards
    for field in fields:
        name, *axes = field.split("/")
        if not name:
            raise ValueError(f"dim {field!r} of {text!r} has an empty name")
        if not _NAME.fullmatch(name):
            raise ValueError(f"dim {field!r} of {text!r}: name {name!r} is not an identifier or a number")
        for axis in axes:
            if not axis:
                raise ValueError(f"dim {field!r} of {text!r} has an empty mesh axis (a stray '/')")
            if axis not in MESH_AXES:
                raise ValueError(
                    f"dim {field!r} of {text!r}: unknown mesh axis {axis!r}; known axes: {', '.join(MESH_AXES)}"
                )
            if axis in owner:
                raise ValueError(f"spec {text!r}: mesh axis {axis!r} shards both {owner[axis]} and {name}")
            owner[axis] = name
        if axes and name.isdigit():
            raise ValueError(f"dim {field!r} of {text!r}: a numeric dim has a fixed size and cannot be sharded")
        if any(d.name == name for d in dims):
            raise ValueError(f"spec {text!r} names dim {name!r} twice")
        dims.append(Dim(name, tuple(axes)))
    return Spec(text, tuple(dims))


@functools.lru_cache(maxsize=4096)
def parse_transition(text: str) -> Transition:
    """Parse 'A, B -> C' into a Transition (inputs A and B, output C). Cached."""
    if not isinstance(text, str) or text.count("->") != 1:
        raise ValueError(f"a spec transition has exactly one '->', like 'B/d L M/t -> B/d L M'; got {text!r}")
    left, right = text.split("->")
    inputs = tuple(parse_spec(part.strip()) for part in left.split(","))
    return Transition(text, inputs, parse_spec(right.strip()))


def as_spec(spec: str | Spec) -> Spec:
    return spec if isinstance(spec, Spec) else parse_spec(spec)


def local_shape(spec: str | Spec, global_shape, axis_sizes) -> tuple[int, ...]:
    """Local shape of a tensor of ``global_shape`` laid out as ``spec`` over the mesh."""
    return as_spec(spec).local_shape(global_shape, axis_sizes)


def global_shape(spec: str | Spec, local_shape, axis_sizes) -> tuple[int, ...]:
    """Global shape of a tensor whose local shard has ``local_shape`` under ``spec``."""
    return as_spec(spec).global_shape(local_shape, axis_sizes)


def check_shape(spec: str | Spec, tensor_or_shape, axis_sizes, **global_sizes: int) -> None:
    """Raise ValueError unless the tensor's local shape fits ``spec`` on the mesh (and the given global sizes).

    >>> check_shape('B/d L M/t', torch.zeros(2, 3, 12), {'d': 1, 'e': 1, 't': 2}, M=48)
    ValueError: dim M of 'B/d L M/t': local size 12 is not global 48 / t=2 = 24
    """
    shape = getattr(tensor_or_shape, "shape", tensor_or_shape)
    as_spec(spec).check(tuple(shape), axis_sizes, global_sizes)


def _axis_sizes(axis_sizes, spec: Spec) -> Mapping[str, int]:
    sizes = getattr(axis_sizes, "axis_sizes", axis_sizes)
    if not isinstance(sizes, Mapping):
        raise ValueError(f"axis_sizes must be a Mesh or a mapping like {{'d': 2, 't': 2}}, got {type(sizes).__name__}")
    missing = sorted(spec.axes - set(sizes))
    if missing:
        raise ValueError(f"spec {spec.text!r} uses mesh axes {missing} that axis_sizes {dict(sizes)} lacks")
    return sizes


def _axes_text(axes: tuple[str, ...], sizes: Mapping[str, int]) -> str:
    return "*".join(f"{a}={sizes[a]}" for a in axes)
