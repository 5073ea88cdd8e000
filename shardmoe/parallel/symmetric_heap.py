"""SymmetricHeap: POSIX shared memory through which the ranks of one node exchange rows (the P2P path).

Every member of an exchange group owns one segment of the same size (hence "symmetric") and maps
the segments of the members that share its node:

    [ header: int64 consumed | int64 ready[group size] | pad to 64 B ][ data: capacity bytes ]

Exchange number `seq` between a sender s and a receiver q on the same node:
  1. s waits until q.consumed >= seq - 1: q has finished reading the previous exchange, so its
     data area may be overwritten;
  2. s copies its rows into q's data area, at an offset both sides compute from the counts that
     every rank already knows, and stores q.ready[s] = seq;
  3. q waits until q.ready[s] == seq for every same-node source that sends it rows, reads them,
     and stores q.consumed = seq.
Each header slot has exactly one writer, so no atomics are needed: an aligned int64 store is
atomic, and x86-64 keeps stores in program order and never moves a load after a later store
(TSO), which is what both hand-offs rely on. Exchange.p2p_supported() keeps other architectures
on the collective path.

Every wait is bounded: past `timeout` seconds it raises PeerTimeoutError naming the peer and
the exchange, so a rank that died or hung makes its node peers fail instead of hang.

Segments live in /dev/shm (where Linux keeps shm_open objects) under a name that holds a random
token broadcast over the group, so concurrent jobs never collide. Each owner unlinks its
segment as soon as every member has mapped it: the mappings stay valid, and nothing is left
behind however a rank ends. Growing is collective (see reserve) and rare: capacity doubles.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

_SHM_DIR = "/dev/shm"
_HEADER_BYTES_ALIGN = 64
_MIN_CAPACITY = 1 << 16
_MAX_POLL_SLEEP_S = 1e-3


class PeerTimeoutError(TimeoutError):
    """A peer did not reach the expected point of an exchange within the timeout."""


class SymmetricHeap:
    """Shared-memory segments of one exchange group; `index` is this rank's position in it.

    group_ranks: global ranks of the group in index order; node_members: indices that share this
    rank's node (this rank included); group: the process group over group_ranks (setup only).
    """

    def __init__(self, group_ranks: list[int], index: int, node_members: list[int], group, timeout: float):
        self.group_ranks, self.index, self.group, self.timeout = group_ranks, index, group, timeout
        self.node_members = node_members
        self.capacity = 0
        self.completed = 0  # last exchange whose rows this rank has read
        self._generation = 0
        self._token = None
        self._headers: dict[int, torch.Tensor] = {}
        self._data: dict[int, torch.Tensor] = {}
        header_slots = 1 + len(group_ranks)
        self._header_bytes = -(-header_slots * 8 // _HEADER_BYTES_ALIGN) * _HEADER_BYTES_ALIGN

    # -- setup (collective over the group) ---------------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Make every data area hold at least nbytes. Collective: every member of the group calls
        it with the same nbytes (all compute it from the same counts), so all grow together."""
        if nbytes <= self.capacity:
            return
        capacity = max(nbytes, 2 * self.capacity, _MIN_CAPACITY)
        capacity = -(-capacity // 4096) * 4096
        if self._token is None:
            token = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64)
            dist.broadcast(token, src=self.group_ranks[0], group=self.group)
            self._token = int(token)
        self._generation += 1
        size = self._header_bytes + capacity
        own = self._path(self.group_ranks[self.index])
        fd = os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        headers, data = {}, {}
        segment = torch.from_file(own, shared=True, size=size, dtype=torch.uint8)
        headers[self.index] = segment[: self._header_bytes].view(torch.int64)
        # The owner has read everything up to `completed`; senders may write the next exchange.
        headers[self.index][0] = self.completed
        data[self.index] = segment[self._header_bytes :]
        dist.barrier(group=self.group)  # every segment of this generation exists
        for member in self.node_members:
            if member != self.index:
                segment = torch.from_file(self._path(self.group_ranks[member]), shared=True, size=size,
                                          dtype=torch.uint8)
                headers[member] = segment[: self._header_bytes].view(torch.int64)
                data[member] = segment[self._header_bytes :]
        dist.barrier(group=self.group)  # every member has mapped every segment it needs
        os.unlink(own)
        self._headers, self._data, self.capacity = headers, data, capacity

    def _path(self, rank: int) -> str:
        return f"{_SHM_DIR}/shardmoe-{self._token:014x}-g{self._generation}-r{rank}"

    # -- one exchange --------------------------------------------------------------------------

    def put(self, dest: int, offset: int, rows: torch.Tensor, seq: int) -> None:
        """Copy rows (uint8, contiguous) into member dest's data area at offset, then flag them."""
        header = self._headers[dest]
        self._wait(lambda: int(header[0]) >= seq - 1, dest, "finish reading the previous exchange", seq)
        nbytes = rows.numel()
        self._data[dest][offset : offset + nbytes].copy_(rows.view(-1))
        header[1 + self.index] = seq

    def received(self, source: int, offset: int, nbytes: int, seq: int) -> torch.Tensor:
        """View of the nbytes member source put at offset of this rank's data area (waits for them).
        Valid until this rank calls done(seq)."""
        header = self._headers[self.index]
        self._wait(lambda: int(header[1 + source]) == seq, source, "send its rows", seq)
        return self._data[self.index][offset : offset + nbytes]

    def done(self, seq: int) -> None:
        """This rank has read everything of exchange seq; senders may overwrite its data area."""
        self.completed = seq
        if self._headers:
            self._headers[self.index][0] = seq

    def _wait(self, ready, member: int, what: str, seq: int) -> None:
        if ready():
            return
        deadline = time.monotonic() + self.timeout
        sleep = 0.0
        while not ready():
            if time.monotonic() > deadline:
                me, peer = self.group_ranks[self.index], self.group_ranks[member]
                raise PeerTimeoutError(
                    f"shared-memory exchange {seq}: rank {me} waited {self.timeout:g} s for rank {peer} to {what}; "
                    f"rank {peer} failed, hung, or runs a different sequence of MoE layers "
                    "(raise SHARDMOE_P2P_TIMEOUT_S to wait longer)"
                )
            # Yield first (the peer may be runnable on this core), then back off to at most 1 ms:
            # ranks routinely outnumber cores, and spinning would starve the peer we wait for.
            if sleep:
                time.sleep(sleep)
            else:
                os.sched_yield()
            sleep = min(max(2 * sleep, 1e-5), _MAX_POLL_SLEEP_S)
