"""Mesh: the ranks of a job laid out on the named axes d (data/FSDP), e (expert), t (tensor).

The layout is row-major with t fastest::

    rank = (d * ep + e) * tp + t

so the ranks of one tensor-parallel group are adjacent (and, with tp <= ranks_per_node, on one
node). The process groups come from ``torch.distributed.device_mesh.init_device_mesh`` with dim
names ('d', 'e', 't'); groups over several axes (e.g. ('d', 'e') for reducing over all token
shards) are built once, in the constructor, because creating a group is a collective that every
rank must enter in the same order.

A Mesh with dp = ep = tp = 1 also works without an initialised process group: every group is then
None and every shardop is the identity, so single-process code and tests need no special case.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable

import torch.distributed as dist

from shardmoe.notation import MESH_AXES

Axes = str | Iterable[str]


class Mesh:
    """Named axes over the world: ``Mesh(dp=2, ep=1, tp=2)`` inside a 4-rank process group.

    ranks_per_node: ranks sharing a node (for P2P versus remote paths); None reads LOCAL_WORLD_SIZE
    (set by torchrun) and falls back to the world size (one node).
    """

    def __init__(self, dp: int = 1, ep: int = 1, tp: int = 1, ranks_per_node: int | None = None):
        for name, value in (("dp", dp), ("ep", ep), ("tp", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Mesh: {name} must be a positive int, got {value!r}")
        self.axis_sizes = {"d": dp, "e": ep, "t": tp}
        # Everything below up to init_device_mesh is local: a bad layout fails on every rank alike,
        # before any rank waits in a collective for the others.
        if dist.is_available() and dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        elif dp * ep * tp == 1:
            self.world_size, self.rank = 1, 0
        else:
            raise ValueError(
                f"Mesh(dp={dp}, ep={ep}, tp={tp}) needs {dp * ep * tp} ranks: initialise torch.distributed "
                "first (torchrun, or shardmoe.testing.run_distributed)"
            )
        if dp * ep * tp != self.world_size:
            raise ValueError(
                f"Mesh(dp={dp}, ep={ep}, tp={tp}): dp*ep*tp = {dp * ep * tp} but the world size is {self.world_size}"
            )
        self.ranks_per_node = _ranks_per_node(ranks_per_node, self.world_size)
        self._coords = self.coords(self.rank)

        self.device_mesh = None
        self._groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
            self.device_mesh = init_device_mesh(device_type, (dp, ep, tp), mesh_dim_names=MESH_AXES)
        for count in range(1, len(MESH_AXES) + 1):
            for axes in itertools.combinations(MESH_AXES, count):
                self._groups[axes] = self._make_group(axes)

    def _make_group(self, axes: tuple[str, ...]) -> dist.ProcessGroup | None:
        # Axes of size 1 do not change the group, so most tuples reuse a group that already exists.
        live = tuple(a for a in axes if self.axis_sizes[a] > 1)
        if not live:
            return None
        if len(live) == 1:
            return self.device_mesh.get_group(live[0])
        if math.prod(self.axis_sizes[a] for a in live) == self.world_size:
            return dist.group.WORLD
        return self.device_mesh[live]._flatten("_".join(live)).get_group()

    # -- sizes and coordinates ---------------------------------------------------------------

    def size(self, axes: Axes = MESH_AXES) -> int:
        """Number of ranks along one axis ('e') or a tuple of axes (('d', 'e'): dp * ep)."""
        return math.prod(self.axis_sizes[a] for a in self._axes(axes))

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Coordinates {'d': ., 'e': ., 't': .} of a global rank (default: this rank)."""
        if rank is None:
            return dict(self._coords)
        self._check_rank(rank, "rank")
        ep, tp = self.axis_sizes["e"], self.axis_sizes["t"]
        return {"d": rank // (ep * tp), "e": rank // tp % ep, "t": rank % tp}

    def coord(self, axes: Axes, rank: int | None = None) -> int:
        """Coordinate of a rank (default: this rank) along one axis or a tuple of axes.

        For a tuple the first axis is the major one: coord(('t', 'd')) = t * dp + d. This is the
        block a dim sharded 'X/t/d' keeps on that rank.
        """
        coords = self.coords(rank)
        index = 0
        for a in self._axes(axes):
            index = index * self.axis_sizes[a] + coords[a]
        return index

    def rank_at(self, **coords: int) -> int:
        """Global rank at the given coordinates; axes left out keep this rank's coordinates.

        mesh.rank_at(e=j) is the peer that holds expert block j in this rank's (d, t) slice.
        """
        full = self.coords()
        for axis, value in coords.items():
            if axis not in self.axis_sizes:
                raise ValueError(f"rank_at: unknown mesh axis {axis!r}; known axes: {', '.join(MESH_AXES)}")
            if not 0 <= value < self.axis_sizes[axis]:
                raise ValueError(f"rank_at: {axis}={value} is outside 0..{self.axis_sizes[axis] - 1}")
            full[axis] = value
        return self._rank_of(full)

    def ranks_along(self, axes: Axes, rank: int | None = None) -> list[int]:
        """Global ranks of the group along ``axes`` through a rank, ordered by coord(axes)."""
        axes = self._axes(axes)
        base = self.coords(rank)
        ranks = []
        for values in itertools.product(*(range(self.axis_sizes[a]) for a in axes)):
            ranks.append(self._rank_of({**base, **dict(zip(axes, values))}))
        return ranks

    # -- process groups ----------------------------------------------------------------------

    def group(self, axes: Axes) -> dist.ProcessGroup | None:
        """Process group over one axis or a tuple of axes (in any order) through this rank.

        None when the axes span one rank (all their sizes are 1): there is nothing to communicate.
        Group ranks follow global rank order, which need not be coord(axes) order for a tuple in
        non-canonical order such as ('t', 'd'); use coord(axes, global_rank) to map.
        """
        axes = self._axes(axes)
        return self._groups[tuple(a for a in MESH_AXES if a in axes)]

    # -- topology ----------------------------------------------------------------------------

    def node_of(self, rank: int) -> int:
        """Node index of a global rank: ranks are packed onto nodes in order, ranks_per_node each."""
        self._check_rank(rank, "rank")
        return rank // self.ranks_per_node

    def same_node(self, rank_a: int, rank_b: int) -> bool:
        """True when two ranks share a node (they can use the P2P path)."""
        return self.node_of(rank_a) == self.node_of(rank_b)

    # -- helpers -----------------------------------------------------------------------------

    def _axes(self, axes: Axes) -> tuple[str, ...]:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in axes:
            if a not in self.axis_sizes:
                raise ValueError(f"unknown mesh axis {a!r}; known axes: {', '.join(MESH_AXES)}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"mesh axes {axes} name an axis twice")
        return axes

    def _rank_of(self, coords: dict[str, int]) -> int:
        return (coords["d"] * self.axis_sizes["e"] + coords["e"]) * self.axis_sizes["t"] + coords["t"]

    def _check_rank(self, rank: int, argument: str) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{argument} {rank} is outside 0..{self.world_size - 1}")

    def __repr__(self) -> str:
        dp, ep, tp = (self.axis_sizes[a] for a in MESH_AXES)
        layout = f"dp={dp}, ep={ep}, tp={tp}, ranks_per_node={self.ranks_per_node}"
        return f"Mesh({layout}; rank {self.rank} at {self._coords})"


def _ranks_per_node(ranks_per_node: int | None, world_size: int) -> int:
    source = "ranks_per_node"
    if ranks_per_node is None and os.environ.get("LOCAL_WORLD_SIZE"):
        source = "LOCAL_WORLD_SIZE"
        try:
            ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an int, got {os.environ['LOCAL_WORLD_SIZE']!r}") from None
    if ranks_per_node is None:
        return world_size
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"{source} = {ranks_per_node} must be positive and divide the world size {world_size}")
    return ranks_per_node


def parse_mesh(text: str) -> dict[str, int]:
    """A --mesh option, 'd=2,e=2' (commas or spaces between items), -> {'d': 2, 'e': 2, 't': 1}.

    An axis named twice is an error (which size was meant is unknowable)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    given: dict[str, str] = {}
    for item in text.replace(",", " ").split():
        axis, _, value = item.partition("=")
        if axis not in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh: expected comma-separated AXIS=SIZE with AXIS in {', '.join(MESH_AXES)} "
                             f"and SIZE >= 1, got {item!r}")
        if axis in given:
            raise ValueError(f"--mesh: expected each axis at most once, got axis {axis!r} twice "
                             f"({given[axis]!r} and {item!r}) in {text!r}")
        given[axis] = item
        sizes[axis] = int(value)
    return sizes


# Which mesh axes a parameter's gradient is summed over after a backward (parallel.sync_grads): a
# tag on the parameter, set where the parameter is made; unmarked parameters count as replicated.
GRAD_SYNC_ATTRIBUTE = "grad_sync_axes"
REPLICATED = ("d", "e")  # the gate and every dense parameter: other tokens on every 'd' and 'e' rank
EXPERT = ("d",)  # an expert shard: the ranks along 'e' hold other experts, every token of the d slice came


def mark_grad_sync(param, axes: tuple[str, ...]) -> None:
    """Record the mesh axes over which param's gradient must be summed by sync_grads."""
    setattr(param, GRAD_SYNC_ATTRIBUTE, tuple(axes))
