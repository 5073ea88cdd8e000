"""The bytes one forward keeps alive for its backward, measured with saved_tensors_hooks.

The report divides them by S (bytes per token) and by transformers' figure (saved/tf).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SavedBytes:
    """What one forward keeps alive for its backward.

    total:   bytes of the distinct storages saved (parameters excluded; the input counted)
    input:   the part of `total` that is the input's own storage
    tensors: how many saved-tensor slots were packed (before deduplication)
    storages: how many distinct storages they held
    storage_bytes: {data_ptr: bytes} of those storages"""

    total: int
    input: int
    tensors: int
    storages: int
    storage_bytes: dict = field(default_factory=dict)

    def in_pools(self, pools) -> int:
        """The part of `total` whose storages are blocks of these workspaces (lent to saved tensors)."""
        return sum(n for ptr, n in self.storage_bytes.items() if any(pool.owns(ptr) for pool in pools))

    @property
    def without_input(self) -> int:
        return self.total - self.input


def measure_saved_bytes(forward, params=(), inputs=()) -> tuple[SavedBytes, object]:
    """Run `forward()` under torch.autograd.graph.saved_tensors_hooks and sum the bytes of
    every distinct storage saved for backward. Returns (SavedBytes, forward's output).

    A storage is counted once however many views of it are saved (dedupe by the storage's
    data_ptr; saved tensors stay alive until backward, so pointers cannot be reused in
    between) and in full (a saved view keeps its whole storage alive). Storages of
    `params` are excluded: they live whether or not backward will run. Storages of
    `inputs` are counted (the layer's backward keeps them alive) and reported apart."""
    import torch

    def ptr(t):
        return t.untyped_storage().data_ptr()

    param_ptrs = {ptr(p) for p in params}
    input_ptrs = {ptr(x) for x in inputs}
    seen: dict[int, int] = {}
    packed = [0]

    def pack(t):
        packed[0] += 1
        p = ptr(t)
        if p and p not in param_ptrs and p not in seen:
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    total = sum(seen.values())
    inp = sum(n for p, n in seen.items() if p in input_ptrs)
    return SavedBytes(total, inp, packed[0], len(seen), dict(seen)), out
