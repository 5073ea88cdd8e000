"""Where a layer's parameters and tokens live: its Placement (the dispatcher, the shards of its
expert parameters on this rank, their DTensor layout), and the state dict's packed layout of the
gate/up tensors.

  LocalPlacement          one process: every parameter whole, the local dispatcher
  MeshPlacement           a mesh: shardmoe/parallel/expert_parallel.py, registered on import
                          (register_mesh_placement) so that this package imports nothing of it
  placement(config, mesh) the placement of a layer
  packed / unpacked       gate_up_proj [E, 2F, H] <-> its [E, 2, F, H] view, as the state dict holds it
  whole_entry             the whole parameter from a state-dict entry, either layout
"""
from __future__ import annotations

from typing import Protocol

import torch

from shardmoe.moe.config import MoEConfig
from shardmoe.moe.dispatch import LOCAL, Dispatcher


class Placement(Protocol):
    """Where a layer's parameters and tokens live: its dispatcher, and the shards of its expert
    parameters on this rank (name: a parameter of the layer; shape: its whole shape)."""

    dispatcher: Dispatcher
    sharded: bool

    def shard_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def layout(self, name: str) -> tuple | None:
        """(DeviceMesh, placements) of parameter `name` when the mesh splits parameters, else None."""

    def parameter(self, name: str, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The data of parameter `name` whose shard on this rank is `local` and whole shape `shape`: a
        DTensor of the whole (sharing local's storage) when the mesh splits parameters, else local."""

    def compute_view(self, name: str, param: torch.Tensor, summed_over_e: bool) -> torch.Tensor:
        """The tensor the forward computes on: a DTensor parameter's local tensor, differentiable, its
        gradient a DTensor of the placements the backward leaves (`summed_over_e`: the backward
        sums the replicated gradients over 'e' itself); a plain parameter as it is."""

    def shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole parameter (no communication)."""

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole parameter from every rank's shard (collective when sharded)."""

    def state_entry(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The layer's state-dict entry of a routed or shared expert parameter from this rank's shard:
        the whole tensor in its state-dict layout (packed), a DTensor when the mesh shards it, sharing
        the shard's storage (distributed checkpoints load into it in place)."""

    def load_entry(self, key: str, name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's shard, in the parameter's shape, of a state-dict entry `key` (state_entry's
        form, or whole_entry's); ValueError naming the key and the shapes for any other."""


# The state dict holds gate_up_proj [E, 2F, H] as its [E, 2, F, H] view (and its bias, and the shared
# expert's, likewise): 't' splits F, so a rank holds a slice of the gate rows and the same slice of the
# up rows, which is one block of the view but two of [E, 2F, H], and a distributed checkpoint's
# DTensor describes one block per rank.
PACKED = ("gate_up_proj", "gate_up_proj_bias", "shared_gate_up_proj")


def packed(name: str, t: torch.Tensor) -> torch.Tensor:
    """gate_up_proj [E, 2F, H] -> its [E, 2, F, H] view, shared_gate_up_proj [2Fs, H] -> [2, Fs, H],
    gate_up_proj_bias [E, 2F] -> [E, 2, F] (the gate rows, then the up rows); others as they are."""
    if name not in PACKED:
        return t
    dim = t.dim() - 2 if name.endswith("proj") else t.dim() - 1  # the 2F dim
    return t.unflatten(dim, (2, t.shape[dim] // 2))


def unpacked(name: str, t: torch.Tensor) -> torch.Tensor:
    """Inverse of packed (a copy if t is a strided shard)."""
    if name not in PACKED:
        return t
    dim = t.dim() - 3 if name.endswith("proj") else t.dim() - 2
    return t.flatten(dim, dim + 1)


def whole_entry(key: str, name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole parameter `name` (its own layout, `shape`) from a state-dict entry holding the whole
    tensor: plain, in the state-dict layout (packed) or the parameter's own (an unsharded state dict
    saved with torch.save), or a DTensor of either, gathered whole (a collective over its mesh).
    ValueError naming the key, the shapes it may have, and the shape it has."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            value = value.full_tensor()
    state_shape = tuple(packed(name, torch.empty(shape, device="meta")).shape)
    if tuple(value.shape) == state_shape:
        return unpacked(name, value)
    if tuple(value.shape) == tuple(shape):
        return value
    also = "" if state_shape == tuple(shape) else f" (or the parameter's layout {list(shape)})"
    raise ValueError(f"state_dict[{key!r}]: expected the whole tensor, of shape {list(state_shape)}{also}, "
                     f"as a tensor or a DTensor, got shape {list(value.shape)}")


class LocalPlacement:
    """One process: every parameter whole, the local dispatcher."""

    dispatcher, sharded = LOCAL, False

    def shard_shape(self, name, shape):
        return tuple(shape)

    def layout(self, name):
        return None

    def parameter(self, name, local, shape):
        return local

    def compute_view(self, name, param, summed_over_e):
        return param

    def shard(self, name, whole):
        return whole

    def gather(self, name, local):
        return local

    def state_entry(self, name, local):
        return packed(name, local)

    def load_entry(self, key, name, value, shape):
        return whole_entry(key, name, value, shape)


_mesh_placement = None  # (config, mesh) -> Placement: shardmoe.parallel registers it on import


def register_mesh_placement(factory) -> None:
    """Set what placement(config, mesh) builds for a mesh: expert parallelism's (shardmoe.parallel
    calls this when imported, which `import shardmoe` does), so this package imports none of it."""
    global _mesh_placement
    _mesh_placement = factory


def placement(config: MoEConfig, mesh) -> Placement:
    """The placement of a layer with `config` on `mesh` (None: one process)."""
    if mesh is None:
        return LocalPlacement()
    if _mesh_placement is None:
        raise RuntimeError("mesh: a layer on a mesh needs shardmoe.parallel, which registers expert parallelism "
                           "(`import shardmoe` imports it)")
    return _mesh_placement(config, mesh)
