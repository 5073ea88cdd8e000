"""Workspace: a per-layer pool of the large row buffers of the fused layer's forward and backward.

Fresh CPU allocations of 32 MiB and more page-fault on every first touch (glibc maps them anew:
docs/benchmarks.md), and a GEMM writing into such a buffer ran at a third of its speed. The row
buffers of one step ([N, 2F] h and its gradient, [N, F] a, act(hg), g Wdown, dA; [N, H] expert
outputs) are therefore taken from blocks this pool keeps across steps.

Ownership. A block is lent by empty() and free again only when nothing but the pool refers to
its storage (the storage's use count is 1): a tensor saved for backward keeps its block until
autograd frees it after that backward (or with the graph), whatever runs in between -- several
forwards before their backwards (gradient accumulation, several layers, activation
checkpointing) each get their own block. So the pool holds as many blocks of a size as were ever
alive at once; nothing is ever handed out twice, also to threads: one lock serialises lending
(layers sharing a pool may run in several threads; each empty() call is atomic).

Sharing. One pool may serve several layers (share(layers); shardmoe.Transformer and hf.convert
give all their MoE layers one). Each layer's saved tensors keep their blocks lent until its
backward, and one layer's scratch buffers are free again before the next layer runs, so the pool
holds every layer's saved blocks plus one layer's scratch, not one working set per layer.
stats['workspace_bytes'] then reports the shared pool.

Size. A request that no free block fits allocates a new block and drops the free blocks of that
device (all smaller than the request): of the request's size the first time, and of at least
1.25x the largest block it replaces after that, so steps that keep growing a little (a batch of
more tokens, fewer drops) do not allocate every time. A block is never larger than needed by
more than that factor, which matters: a saved tensor's block counts whole in the saved bytes. release() forgets every block (blocks still lent stay alive with
their tensors and are freed with them); MoE.to() / _apply call it, since blocks never move.
resident_bytes counts every block the pool holds, lent or free.
"""
from __future__ import annotations

import math
import threading

import torch

# Below this a request is served by the allocator: glibc recycles small blocks itself, and a pool
# block per small tensor would only add resident bytes (4 MiB: the size the per-expert outputs
# that glibc reused were, docs/benchmarks.md).
MIN_POOLED_BYTES = 4 << 20
GROWTH = 1.25


def _use_count(storage: torch.UntypedStorage) -> int:
    """References to the storage's data (the pool's own included), as torch counts them."""
    return torch._C._storage_Use_Count(storage._cdata)


class Workspace:
    """Blocks of reusable memory, per device, lent out as tensors of any dtype and shape."""

    def __init__(self, min_bytes: int = MIN_POOLED_BYTES):
        """min_bytes: smaller requests are allocated by torch."""
        if min_bytes < 0:
            raise ValueError(f"min_bytes: expected >= 0, got {min_bytes}")
        self.min_bytes = min_bytes
        self._blocks: list[torch.UntypedStorage] = []
        # one lender at a time: a block is free until the tensor made on it exists, and making that
        # tensor releases the GIL, so two threads could otherwise be lent the same block
        self._lock = threading.Lock()

    def __reduce__(self):
        """A copy (copy.deepcopy, pickle) is an empty pool of the same settings: blocks are scratch."""
        return Workspace, (self.min_bytes,)

    @property
    def resident_bytes(self) -> int:
        """Bytes of every block the pool holds (lent or free)."""
        return sum(b.nbytes() for b in self._blocks)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` (its contents are whatever the block last
        held): from a free block when one fits, else from a new one; below min_bytes, from torch."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        device = torch.device(device)
        if nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            return self._lend(nbytes, shape, dtype, device)

    def _lend(self, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """empty()'s pooled case; the caller holds the lock."""
        block = self._choose_block(nbytes, device)
        return torch.empty(0, dtype=dtype, device=device).set_(block, 0, shape)

    def _choose_block(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        """The smallest free block of at least nbytes on device, or a new one (see "Size" above)."""
        free = [b for b in self._blocks if b.device == device and _use_count(b) == 1]
        fitting = [b for b in free if b.nbytes() >= nbytes]
        if fitting:
            block = min(fitting, key=lambda b: b.nbytes())
        else:
            self._blocks = [b for b in self._blocks if not any(b is f for f in free)]
            size = max([nbytes] + [int(b.nbytes() * GROWTH) for b in free])
            block = torch.empty(size, dtype=torch.uint8, device=device).untyped_storage()
            self._blocks.append(block)
        return block

    def owns(self, data_ptr: int) -> bool:
        """Whether data_ptr lies in one of the pool's blocks (a saved tensor the pool lent)."""
        return any(b.data_ptr() <= data_ptr < b.data_ptr() + b.nbytes() for b in self._blocks)

    def empty_copy(self) -> "Workspace":
        """A workspace of the same settings holding no blocks (for copies of a layer)."""
        return Workspace(self.min_bytes)

    def release(self) -> None:
        """Forget every block: free ones are freed now, lent ones with their last tensor."""
        with self._lock:
            self._blocks = []


def share(layers) -> Workspace:
    """One new pool for every layer in `layers` (MoE modules): see "Sharing" above."""
    pool = Workspace()
    for layer in layers:
        layer.workspace = pool
    return pool


def empty_rows(workspace: Workspace | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `shape` with like's dtype and device: from `workspace` when one is
    given, else a fresh allocation (the stage functions' default)."""
    if workspace is None:
        return like.new_empty(shape)
    return workspace.empty(tuple(shape), like.dtype, like.device)
