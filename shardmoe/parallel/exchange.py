"""RowExchange: the uneven all-to-all of rows among the ranks of one mesh axis, over two paths.

Rows travel as bytes ([N, B] uint8): pack_rows lays several per-row tensors side by side (the
input rows and their combine weights, say) so that one exchange moves them all, each keeping its
own dtype. A rank sends rows[prefix of counts[me]] to each peer in group order and receives, from
each source in group order, counts[source][me] rows, concatenated.

Paths, chosen per pair of ranks from mesh.ranks_per_node (FlashMoE's two paths, P2P within a node
and remote across nodes; docs/parallel.md):
  self    the rows are copied locally;
  P2P     a peer on the same node: the sender writes straight into the receiver's segment of a
          SymmetricHeap (POSIX shared memory) and raises a flag;
  remote  a peer on another node: torch.distributed.all_to_all_single over the axis' group,
          with zero-length splits for every pair that is not remote.
Both paths only copy bytes and the received rows are assembled in the same order, so the result
is bit-identical whichever path each pair takes. A mesh with ranks_per_node=1 sends every pair
through the collective (how tests and benchmarks fake several nodes on one machine). CUDA tensors
and CPUs without x86 store ordering always use the collective path (the CUDA symmetric-memory
transport is not written yet).

`counts` is the full [G, G] matrix (counts[s][q] rows from group index s to q), which every rank
of the group knows (DispatchPlan): with it each sender computes where its rows land in a peer's
heap, and every rank reaches the same decision to grow the heap, which is collective.
"""
from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import time
import weakref

import torch
import torch.distributed as dist

from shardmoe.parallel.symmetric_heap import SymmetricHeap

DEFAULT_P2P_TIMEOUT_S = 120.0
_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class ExchangeError(RuntimeError):
    """A collective of the remote path failed (a peer died, hung past the timeout, or disagreed)."""


def p2p_supported() -> bool:
    """The shared-memory flags rely on x86-64 store ordering (see symmetric_heap)."""
    return os.path.isdir("/dev/shm") and platform.machine().lower() in ("x86_64", "amd64")


def pack_rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """Lay per-row tensors [N, ...] side by side as bytes: -> ([N, B] uint8, layout for unpack_rows)."""
    rows = tensors[0].shape[0]
    parts, layout = [], []
    for t in tensors:
        per_row = math.prod(t.shape[1:])
        parts.append(t.contiguous().view(rows, per_row).view(torch.uint8))
        layout.append((t.dtype, tuple(t.shape[1:])))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), layout


def unpack_rows(data: torch.Tensor, layout) -> list[torch.Tensor]:
    """Inverse of pack_rows: [N, B] uint8 -> the tensors, each [N, ...] in its own dtype."""
    rows, out, start = data.shape[0], [], 0
    for dtype, shape in layout:
        width = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        part = data[:, start : start + width]
        out.append(part.contiguous().view(dtype).view(rows, *shape))
        start += width
    return out


def select_rows(data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """data[index] for packed rows [N, B] uint8 -> [len(index), B], moved as the widest machine word
    that divides B: a byte-wise gather costs 5-25x more on CPU (docs/parallel.md)."""
    data = data.contiguous()
    width, address = data.shape[1], data.data_ptr()
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if width % w.itemsize == 0 and data.stride(0) % w.itemsize == 0 and address % w.itemsize == 0)
    return data.view(word).index_select(0, index).view(torch.uint8)


def shared_exchange(mesh, axis: str = "e") -> "RowExchange":
    """The RowExchange of a mesh axis, shared by every layer on that mesh: exchanges run one at a
    time in the same order on every rank, so one heap (sized for the largest) serves them all."""
    per_mesh = _SHARED.setdefault(mesh, {})
    if axis not in per_mesh:
        per_mesh[axis] = RowExchange(mesh, axis)
    return per_mesh[axis]


class RowExchange:
    """Uneven all-to-all of byte rows over one mesh axis ('e' for expert parallelism).

    timeout: seconds a P2P wait may last (default SHARDMOE_P2P_TIMEOUT_S, else 120)."""

    def __init__(self, mesh, axis: str = "e", timeout: float | None = None):
        if timeout is None:
            timeout = float(os.environ.get("SHARDMOE_P2P_TIMEOUT_S", DEFAULT_P2P_TIMEOUT_S))
        self.axis = axis
        self.ranks = mesh.ranks_along(axis)
        self.index = mesh.coord(axis)
        self.group = mesh.group(axis)
        size = len(self.ranks)
        local = p2p_supported()
        # same_node[s][q]: whether the pair (s, q) takes the P2P path. Every rank of the group
        # computes the whole matrix, so all agree on whether the collective is needed.
        self.same_node = [[local and s != q and mesh.same_node(self.ranks[s], self.ranks[q]) for q in range(size)]
                          for s in range(size)]
        self.any_remote = any(s != q and not self.same_node[s][q] for s in range(size) for q in range(size))
        self.any_p2p = any(any(row) for row in self.same_node)
        node = [q for q in range(size) if q == self.index or self.same_node[self.index][q]]
        self.heap = SymmetricHeap(self.ranks, self.index, node, self.group, timeout) if self.any_p2p else None
        # the collective lays its splits out in group rank order (ascending global rank), which a
        # DeviceMesh may number otherwise than the axis
        self.group_order = sorted(range(size), key=lambda q: self.ranks[q])
        self.seq = 0

    @contextlib.contextmanager
    def tell_peers_on_failure(self):
        """When an exception leaves the block, mark this rank failed in its heap header: node peers
        waiting on it then raise PeerExitedError within a liveness period instead of the timeout."""
        try:
            yield
        except BaseException:
            if self.heap is not None:
                self.heap.mark_failed()
            raise

    def path(self, source: int, dest: int, device_type: str = "cpu") -> str:
        """'self', 'p2p' or 'remote' for rows (on a device of device_type) from group index source to dest."""
        if source == dest:
            return "self"
        return "p2p" if self.same_node[source][dest] and device_type == "cpu" else "remote"

    def exchange(self, rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Send rows [sum(counts[me]), B] (uint8, grouped by destination) -> [sum_s counts[s][me], B]."""
        self.seq += 1
        seq, me, size = self.seq, self.index, len(self.ranks)
        width = rows.shape[1]
        rows = rows.contiguous()
        send_start = _exclusive_prefix(counts[me])
        recv = [counts[s][me] for s in range(size)]
        p2p = self.heap is not None and rows.device.type == "cpu"
        if p2p:
            self.heap.reserve(width * max(self._p2p_rows_into(q, counts) for q in range(size)))
            for q in range(size):
                if self.same_node[me][q] and counts[me][q]:
                    offset = self._p2p_rows_into(q, counts, before=me) * width
                    start = send_start[q]
                    self.heap.put(q, offset, rows[start : start + counts[me][q]], seq)

        remote_out = None
        if self.any_remote or (self.any_p2p and not p2p):
            remote_out = self._collective(rows, counts, send_start, recv, p2p, seq)

        pieces = []
        for s in range(size):
            if s == me:
                pieces.append(rows[send_start[me] : send_start[me] + recv[me]])
            elif p2p and self.same_node[s][me]:
                if recv[s]:
                    offset = self._p2p_rows_into(me, counts, before=s) * width
                    pieces.append(self.heap.received(s, offset, recv[s] * width, seq).view(recv[s], width))
            else:
                pieces.append(remote_out[s])
        out = torch.cat(pieces) if pieces else rows.new_empty((0, width))
        if self.heap is not None:
            self.heap.done(seq)
        return out

    def _p2p_rows_into(self, dest: int, counts, before: int | None = None) -> int:
        """Rows that same-node sources with index < before (all if None) put into dest's heap."""
        limit = len(self.ranks) if before is None else before
        return sum(counts[s][dest] for s in range(limit) if self.same_node[s][dest])

    def _collective(self, rows, counts, send_start, recv, p2p: bool, seq: int) -> dict[int, torch.Tensor]:
        """The all_to_all_single of the pairs the heap does not carry -> {source index: its rows}."""
        me, size, order = self.index, len(self.ranks), self.group_order
        # Pairs the heap carries (and the self pair) travel as zero-length splits.
        carried = [q == me or (p2p and self.same_node[me][q]) for q in range(size)]
        send = [0 if carried[q] else counts[me][q] for q in range(size)]
        recv_remote = [0 if (s == me or (p2p and self.same_node[s][me])) else recv[s] for s in range(size)]
        parts = [rows[send_start[q] : send_start[q] + send[q]] for q in order if send[q]]
        inp = torch.cat(parts) if parts else rows.new_empty((0, rows.shape[1]))
        out = rows.new_empty((sum(recv_remote), rows.shape[1]))
        try:
            dist.all_to_all_single(out, inp, [recv_remote[s] for s in order], [send[q] for q in order],
                                   group=self.group)
        except RuntimeError as err:
            raise ExchangeError(
                f"remote exchange {seq} over mesh axis {self.axis!r} (ranks {self.ranks}) failed on rank "
                f"{self.ranks[me]}: a peer failed, hung or left; cause: {err}"
            ) from err
        received, start = {}, 0
        for s in order:
            received[s] = out[start : start + recv_remote[s]]
            start += recv_remote[s]
        return received


def time_exchange(mesh, rows: int, width: int, repeats: int) -> float:
    """Median seconds of one exchange over 'e' of rows // G rows of width bytes from every rank to
    each of its G peers (itself included): the dropless average of rows = S k dispatched rows.
    Every rank of the world calls it; each timed exchange starts after a barrier. The expert-parallel
    benchmark (shardmoe.tools.bench.distributed) and the simulator's calibration
    (shardmoe.simulate.calibrate) time the transport with it."""
    exchange = shared_exchange(mesh, "e")
    peers = mesh.size("e")
    per_peer = rows // peers
    counts = [[per_peer] * peers for _ in range(peers)]
    data = torch.randint(0, 256, (per_peer * peers, width), dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):  # the first exchange may grow the heap
        dist.barrier()
        start = time.perf_counter()
        exchange.exchange(data, counts)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _exclusive_prefix(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        out.append(total)
        total += v
    return out
