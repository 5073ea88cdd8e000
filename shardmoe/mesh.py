"""Mesh: the ranks of a job laid out on the named axes p (pipeline), d (data/FSDP), e (expert), t (tensor).

A Mesh is a torch ``DeviceMesh`` read through three named axes, d, e and t, the axes a tensor is
sharded over. Its ranks are numbered in the canonical row-major (d, e, t) order, t fastest: the
mesh index of the rank at (d, e, t) is

    index = (d * ep + e) * tp + t

and ``Mesh(dp, ep, tp)``, which lays the whole world out as one DeviceMesh with dim names
('dp', 'ep', 'tp'), makes the index the global rank (so the ranks of one tensor-parallel group are
adjacent and, with tp <= ranks_per_node, on one node). ``Mesh.from_device_mesh(dm)`` takes the
DeviceMesh a job composed, or a sub-mesh of it (``job_mesh["ep"]``): its dim names are any of
'dp', 'ep', 'tp' in any order (a missing axis has size 1), its ranks need not be the world, and
the table of global ranks by mesh index comes from its ``mesh`` tensor permuted to (d, e, t)
order. Every method speaks global ranks (``rank_at``, ``ranks_along``, ``coords(rank)``);
``coord(MESH_AXES, rank)`` is a rank's mesh index, the row it owns in a table gathered over the
whole mesh.

The pipeline axis p is outermost (as torchtitan lays it out): ``Mesh(dp, ep, tp, pp=P)`` spans a
world of P * dp * ep * tp ranks, one DeviceMesh ('pp', 'dp', 'ep', 'tp'), and the global rank of
the rank at (p, d, e, t) is

    rank = ((p * dp + d) * ep + e) * tp + t

Pipeline stage p holds other layers than stage p + 1, so no tensor is sharded over p: the Mesh a
rank builds is its own stage's (d, e, t) sub-mesh (``device_mesh`` is the 'pp' slice of this
rank, ``size()`` counts dp * ep * tp, every group and table is of this stage's ranks), and the
pipeline is described beside it: ``pipeline_size`` (P), ``stage`` (this rank's p), and
``pipeline_group`` / ``pipeline_ranks`` (the ranks with this rank's (d, e, t) at every p, which
pass activations and gradients between stages). So a layer built on the Mesh, its collectives
and its handshakes, involve one stage's ranks only; ``world_size`` is the whole job's.

The process groups are the DeviceMesh's own: one dim's group for one live axis, the DeviceMesh's
flattened sub-mesh for several (the world group when they span every rank of the job), each with
the default group's timeout on CPU (group_options). They are built once, in the constructor, because creating a group is a collective that every rank of the
job must enter in the same order. The one exception, ordered_device_mesh (a DeviceMesh of the same
ranks in another dim order, for DTensors of specs like 'M/t/d'), is built on first request: its
callers ask while every rank builds the same model (shardmoe/parallel/dtensors.py prepare).

A Mesh with dp = ep = tp = 1 also works without an initialised process group: every group is then
None and every shardop is the identity, so single-process code and tests need no special case.
"""

from __future__ import annotations

import itertools
import math
import os
import weakref
from collections.abc import Iterable

import torch.distributed as dist

from shardmoe.notation import MESH_AXES

Axes = str | Iterable[str]

# the DeviceMesh dim name of each mesh axis: the names torch users give data, expert and tensor parallelism
DEVICE_MESH_NAMES = {"d": "dp", "e": "ep", "t": "tp"}
# the pipeline axis: its DeviceMesh dim name, and the axes a --mesh option of a pipelined job names
PIPELINE_NAME = "pp"
PIPELINE_MESH_AXES = ("p",) + MESH_AXES

# Mesh.from_device_mesh's Meshes by default process group, then (DeviceMesh, ranks_per_node), so
# that layers built on one DeviceMesh (or on equal slices of it, which compare equal) share their
# groups and exchanges. The default group is part of the key because a DeviceMesh built after the
# process group is destroyed and initialised again compares equal to one built before it.
_FROM_DEVICE_MESH: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict]" = weakref.WeakKeyDictionary()


class Mesh:
    """Named axes over the world: ``Mesh(dp=2, ep=1, tp=2)`` inside a 4-rank process group;
    ``Mesh(ep=2, pp=2)`` inside a 4-rank one is this rank's pipeline stage's ep=2 mesh.

    ranks_per_node: ranks sharing a node (for P2P versus remote paths); None reads LOCAL_WORLD_SIZE
    (set by torchrun) and falls back to the world size (one node).

    Attributes: axis_sizes {'d': dp, 'e': ep, 't': tp}; rank (this rank's global rank); world_size
    (ranks of the whole job, which the mesh may be part of: size() counts the mesh's own);
    ranks_per_node; device_mesh (the torch DeviceMesh, None without a process group); parameter_mesh
    (its 'ep' and 'tp' dims: what a sharded layer's DTensor parameters live on, or None);
    pipeline_size, stage, pipeline_ranks, pipeline_group (the p axis: 1, 0, [rank], None without one).
    """

    def __init__(self, dp: int = 1, ep: int = 1, tp: int = 1, ranks_per_node: int | None = None, *, pp: int = 1):
        for name, value in (("dp", dp), ("ep", ep), ("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Mesh: {name} must be a positive int, got {value!r}")
        # Everything up to init_device_mesh is local: a bad layout fails on every rank alike,
        # before any rank waits in a collective for the others.
        layout = f"dp={dp}, ep={ep}, tp={tp}" + (f", pp={pp}" if pp > 1 else "")
        product = "dp*ep*tp" if pp == 1 else "pp*dp*ep*tp"
        ranks = pp * dp * ep * tp
        if dist.is_available() and dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        elif ranks == 1:
            world_size, rank = 1, 0
        else:
            raise ValueError(
                f"Mesh({layout}) needs {ranks} ranks: initialise torch.distributed "
                "first (torchrun, or shardmoe.testing.run_distributed)"
            )
        if ranks != world_size:
            raise ValueError(f"Mesh({layout}): {product} = {ranks} but the world size is {world_size}")
        ranks_per_node = _ranks_per_node(ranks_per_node, world_size)
        stage_size = dp * ep * tp
        stage = rank // stage_size
        device_mesh = root = None
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
            names = tuple(DEVICE_MESH_NAMES[a] for a in MESH_AXES)
            shape, dims = ((dp, ep, tp), names) if pp == 1 else ((pp, dp, ep, tp), (PIPELINE_NAME,) + names)
            options = group_options(device_type)
            built = init_device_mesh(device_type, shape, mesh_dim_names=dims,
                                     backend_override=None if options is None else dict.fromkeys(range(len(dims)),
                                                                                                   options))
            device_mesh, root = (built, None) if pp == 1 else (built[names], built)
        self._setup({"d": dp, "e": ep, "t": tp}, list(range(stage * stage_size, (stage + 1) * stage_size)), rank,
                    world_size, ranks_per_node, device_mesh)
        self._root = root
        self.pipeline_size, self.stage = pp, stage
        self.pipeline_ranks = [p * stage_size + rank % stage_size for p in range(pp)]
        self.pipeline_group = root.get_group(PIPELINE_NAME) if root is not None else None

    @classmethod
    def from_device_mesh(cls, device_mesh, ranks_per_node: int | None = None) -> "Mesh":
        """The Mesh of a torch DeviceMesh whose mesh_dim_names are drawn from 'dp', 'ep', 'tp' (any
        subset, any order; a missing axis has size 1), e.g. a job mesh or its slice ``dm["ep"]``.

        The groups are the DeviceMesh's (a flattened sub-mesh of it for several axes, built here:
        every rank of the job calls this alike). One Mesh per DeviceMesh (equal slices count as
        one) and ranks_per_node, so layers on it share their exchanges. ValueError, before any
        communication, for other dim names, no names, or a DeviceMesh without this rank."""
        names = device_mesh.mesh_dim_names
        accepted = tuple(DEVICE_MESH_NAMES.values())
        if not names or any(n not in accepted for n in names) or len(set(names)) != len(names):
            raise ValueError(f"mesh: expected a DeviceMesh whose mesh_dim_names are distinct names among "
                             f"{', '.join(map(repr, accepted))} (any subset, any order), got mesh_dim_names {names!r}")
        world_size, rank = dist.get_world_size(), dist.get_rank()
        ranks_per_node = _ranks_per_node(ranks_per_node, world_size)
        meshes, key = _FROM_DEVICE_MESH.setdefault(dist.group.WORLD, {}), (device_mesh, ranks_per_node)
        if key not in meshes:
            if device_mesh.get_coordinate() is None:
                raise ValueError(f"mesh: expected a DeviceMesh that holds this rank, got {device_mesh} "
                                 f"without rank {rank}")
            sizes = {a: device_mesh.size(names.index(n)) if n in names else 1 for a, n in DEVICE_MESH_NAMES.items()}
            # the mesh tensor's dims permuted to canonical (d, e, t) order, absent axes of size 1
            present = [names.index(DEVICE_MESH_NAMES[a]) for a in MESH_AXES if DEVICE_MESH_NAMES[a] in names]
            table = device_mesh.mesh.permute(present).reshape(-1).tolist()
            mesh = cls.__new__(cls)
            mesh._setup(sizes, table, rank, world_size, ranks_per_node, device_mesh)
            mesh._root, mesh.pipeline_size, mesh.stage, mesh.pipeline_ranks, mesh.pipeline_group = None, 1, 0, [rank], None
            meshes[key] = mesh
        return meshes[key]

    def _setup(self, sizes: dict[str, int], table: list[int], rank: int, world_size: int, ranks_per_node: int,
               device_mesh) -> None:
        """table: the global rank at each mesh index (canonical row-major (d, e, t) order)."""
        self.axis_sizes = sizes
        self.world_size, self.rank, self.ranks_per_node = world_size, rank, ranks_per_node
        self.device_mesh = device_mesh
        self._table = table
        self._index = {r: i for i, r in enumerate(table)}
        self._coords = self.coords(rank)
        self._groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        self._ordered: dict[tuple[str, ...], object] = {}
        for count in range(1, len(MESH_AXES) + 1):
            for axes in itertools.combinations(MESH_AXES, count):
                self._groups[axes] = self._make_group(axes)
        self.parameter_mesh = self._parameter_mesh()

    def _parameter_mesh(self):
        """The DeviceMesh that a sharded layer's parameters are DTensors on: device_mesh sliced to its
        'ep' and 'tp' dims of more than one rank, in its own dim order (torch refuses another); None
        when neither splits anything. 'dp' is left out: its ranks are data-parallel replicas, whose
        gradients sync_grads or FSDP reduce, and FSDP2 takes a DTensor parameter only on a mesh
        apart from its own ('dp')."""
        live = {DEVICE_MESH_NAMES[a] for a in ("e", "t") if self.axis_sizes[a] > 1}
        if not live or self.device_mesh is None:
            return None
        return self.device_mesh[tuple(n for n in self.device_mesh.mesh_dim_names if n in live)]

    def _make_group(self, axes: tuple[str, ...]) -> dist.ProcessGroup | None:
        # Axes of size 1 do not change the group, so most tuples reuse a group that already exists.
        live = tuple(a for a in axes if self.axis_sizes[a] > 1)
        if not live:
            return None
        if len(live) == 1:
            return self.device_mesh.get_group(DEVICE_MESH_NAMES[live[0]])
        if math.prod(self.axis_sizes[a] for a in live) == self.world_size:
            return dist.group.WORLD  # the axes span every rank of the job
        # slicing keeps the DeviceMesh's own dim order (torch refuses another); a group's membership
        # does not depend on it, and shardops maps group ranks to blocks by coord()
        names = self.device_mesh.mesh_dim_names
        dims = tuple(n for n in names if n in {DEVICE_MESH_NAMES[a] for a in live})
        options = group_options(self.device_mesh.device_type)
        return self.device_mesh[dims]._flatten(backend_override=options).get_group()

    # -- sizes and coordinates ---------------------------------------------------------------

    def size(self, axes: Axes = MESH_AXES) -> int:
        """Number of ranks along one axis ('e') or a tuple of axes (('d', 'e'): dp * ep)."""
        return math.prod(self.axis_sizes[a] for a in self._axes(axes))

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Coordinates {'d': ., 'e': ., 't': .} of a global rank of the mesh (default: this rank)."""
        if rank is None:
            return dict(self._coords)
        self._check_rank(rank, "rank")
        index = self._index[rank]
        ep, tp = self.axis_sizes["e"], self.axis_sizes["t"]
        return {"d": index // (ep * tp), "e": index // tp % ep, "t": index % tp}

    def coord(self, axes: Axes, rank: int | None = None) -> int:
        """Coordinate of a rank (default: this rank) along one axis or a tuple of axes.

        For a tuple the first axis is the major one: coord(('t', 'd')) = t * dp + d. This is the
        block a dim sharded 'X/t/d' keeps on that rank; coord(MESH_AXES, rank) is its mesh index.
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
        """Global ranks of the group along ``axes`` through a rank, ordered by coord(axes).
        ranks_along(MESH_AXES) lists the mesh's ranks by mesh index."""
        axes = self._axes(axes)
        base = self.coords(rank)
        ranks = []
        for values in itertools.product(*(range(self.axis_sizes[a]) for a in axes)):
            ranks.append(self._rank_of({**base, **dict(zip(axes, values))}))
        return ranks

    # -- process groups ----------------------------------------------------------------------

    def ordered_device_mesh(self, order: tuple[str, ...]):
        """A DeviceMesh over the same ranks as device_mesh with its dims in `order` (axes among d, e,
        t that device_mesh has; names 'dp', 'ep', 'tp'), for DTensors that cut one tensor dim over
        several axes in that order (shardmoe/parallel/dtensors.py). Built once per order; building
        it makes process groups, a collective: every rank of the job asks alike."""
        if order not in self._ordered:
            from torch.distributed.device_mesh import DeviceMesh

            names = tuple(DEVICE_MESH_NAMES[a] for a in order)
            base = self.device_mesh if self._root is None else self._root
            own = base.mesh_dim_names
            # the whole job's mesh with its stage dims permuted when pipelined (every stage builds it),
            # then this rank's stage of it
            permutation = ([] if self._root is None else [0]) + [own.index(n) for n in names]
            dims = names if self._root is None else (PIPELINE_NAME,) + names
            options = group_options(base.device_type)
            built = DeviceMesh(base.device_type, base.mesh.permute(permutation), mesh_dim_names=dims,
                               backend_override=None if options is None else (options,) * len(dims))
            self._ordered[order] = built if self._root is None else built[names]
        return self._ordered[order]

    def group(self, axes: Axes) -> dist.ProcessGroup | None:
        """Process group over one axis or a tuple of axes (in any order) through this rank.

        None when the axes span one rank (all their sizes are 1): there is nothing to communicate.
        Group ranks follow global rank order, which need not be coord(axes) order (a tuple in
        non-canonical order such as ('t', 'd'), or a DeviceMesh that numbers its ranks otherwise);
        use coord(axes, global_rank) to map.
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
        return self._table[(coords["d"] * self.axis_sizes["e"] + coords["e"]) * self.axis_sizes["t"] + coords["t"]]

    def _check_rank(self, rank: int, argument: str) -> None:
        if rank not in self._index:
            raise ValueError(f"{argument} {rank} is not a rank of this mesh; its ranks are "
                             f"{', '.join(map(str, sorted(self._table)))}")

    def __deepcopy__(self, memo) -> "Mesh":
        """The mesh itself: it names the job's process groups, which a copy of a module on the mesh
        (copy.deepcopy, torch.optim.swa_utils.AveragedModel) runs on as the original does (a
        ProcessGroup cannot be copied)."""
        return self

    def __repr__(self) -> str:
        dp, ep, tp = (self.axis_sizes[a] for a in MESH_AXES)
        pipeline = f", pp={self.pipeline_size} (stage {self.stage})" if self.pipeline_size > 1 else ""
        layout = f"dp={dp}, ep={ep}, tp={tp}{pipeline}, ranks_per_node={self.ranks_per_node}"
        return f"Mesh({layout}; rank {self.rank} at {self._coords})"


def as_mesh(mesh) -> Mesh | None:
    """What a layer's ``mesh=`` argument names: None (one process), a Mesh, or a torch DeviceMesh
    (Mesh.from_device_mesh) -> None or a Mesh. ValueError for anything else."""
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    if dist.is_available():
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(mesh, DeviceMesh):
            return Mesh.from_device_mesh(mesh)
    raise ValueError(f"mesh: expected None, a shardmoe.Mesh or a torch.distributed.device_mesh.DeviceMesh, "
                     f"got {type(mesh).__name__}")


def group_options(device_type: str) -> tuple[str, object] | None:
    """("gloo", options) for the process groups a Mesh creates on CPU: the default group's timeout.
    A DeviceMesh's groups otherwise wait torch's default (30 minutes for gloo) whatever timeout the
    job gave init_process_group, and a peer that failed would hold its partners that long. None on
    CUDA: NCCL groups keep torch's defaults (no multi-GPU machine here to test an override on)."""
    if device_type != "cpu":
        return None
    import torch

    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device_type))
    options = type(backend.options)()
    options._timeout = backend.options._timeout
    return "gloo", options


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


def parse_mesh(text: str, axes: tuple[str, ...] = MESH_AXES) -> dict[str, int]:
    """A --mesh option, 'd=2,e=2' (commas or spaces between items), -> {'d': 2, 'e': 2, 't': 1}: a size
    for each of `axes` (PIPELINE_MESH_AXES for a command that pipelines: 'p=2,e=2' -> {'p': 2, ...}).

    An axis named twice is an error (which size was meant is unknowable)."""
    sizes = dict.fromkeys(axes, 1)
    given: dict[str, str] = {}
    for item in text.replace(",", " ").split():
        axis, _, value = item.partition("=")
        if axis not in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh: expected comma-separated AXIS=SIZE with AXIS in {', '.join(axes)} "
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
