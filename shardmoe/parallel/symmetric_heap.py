"""SymmetricHeap: POSIX shared memory through which the ranks of one node exchange rows (the P2P path).

Every member of an exchange group owns one segment of the same size (hence "symmetric") and maps
the segments of the members that share its node:

    [ header: int64 consumed | int64 state | int64 pid | int64 ready[group size] | pad to 64 B ]
    [ data: capacity bytes ]

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
the exchange, so a rank that hung makes its node peers fail instead of hang. A peer that failed
is noticed within _LIVENESS_PERIOD_S instead, through two signs its owner leaves in the header:
  state  RUNNING, or FAILED once an exception left this rank's MoE layer (mark_failed, called by
         the layer), or EXITING / EXITING_AFTER_ERROR from an atexit hook (the interpreter is
         shutting down, after an uncaught exception or not): these are stored by a live process;
  pid    the owner's process id: a wait also checks that the process still runs (by its start
         time in /proc/<pid>/stat, so a zombie or a reused pid counts as gone), which catches the
         deaths that run no Python (os._exit, a signal, the OOM killer).
Either raises PeerExitedError naming the peer, what it was waited for, and why it is gone.

Segments live in /dev/shm (where Linux keeps shm_open objects) under a name that holds a random
token broadcast over the group, so concurrent jobs never collide. Each owner unlinks its
segment as soon as every member has mapped it: the mappings stay valid, and nothing is left
behind however a rank ends. Growing is collective (see reserve) and rare: capacity doubles.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist

_SHM_DIR = "/dev/shm"
_HEADER_BYTES_ALIGN = 64
_MIN_CAPACITY = 1 << 16
_MAX_POLL_SLEEP_S = 1e-3
_LIVENESS_PERIOD_S = 0.05  # how often a waiting rank checks that its peer is still there
# header slots, then ready[group size]
_CONSUMED, _STATE, _PID, _READY = 0, 1, 2, 3
RUNNING, FAILED, EXITING, EXITING_AFTER_ERROR = 1, 2, 3, 4
_STATE_TEXT = {
    FAILED: "raised an exception in its MoE layer",
    EXITING: "is exiting (its interpreter is shutting down)",
    EXITING_AFTER_ERROR: "is exiting after an uncaught exception",
}


class PeerTimeoutError(TimeoutError):
    """A peer did not reach the expected point of an exchange within the timeout."""


class PeerExitedError(RuntimeError):
    """A peer of an exchange raised, is exiting, or its process is gone."""


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
        self._state = RUNNING
        self._peer_process: dict[int, tuple[int, int]] = {}  # member -> (pid, start time), when visible
        header_slots = _READY + len(group_ranks)
        atexit.register(_mark_exiting, weakref.ref(self))
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
        headers[self.index][_CONSUMED] = self.completed
        headers[self.index][_STATE] = self._state
        headers[self.index][_PID] = os.getpid()
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
        # A pid this rank cannot see (another pid namespace, no /proc) leaves only the state word.
        self._peer_process = {}
        for member, header in headers.items():
            pid = int(header[_PID])
            start = _process_start(pid)
            if member != self.index and start is not None:
                self._peer_process[member] = (pid, start)

    def _path(self, rank: int) -> str:
        return f"{_SHM_DIR}/shardmoe-{self._token:014x}-g{self._generation}-r{rank}"

    # -- one exchange --------------------------------------------------------------------------

    def put(self, dest: int, offset: int, rows: torch.Tensor, seq: int) -> None:
        """Copy rows (uint8, contiguous) into member dest's data area at offset, then flag them."""
        header = self._headers[dest]
        self._wait(lambda: int(header[_CONSUMED]) >= seq - 1, dest, "finish reading the previous exchange", seq)
        nbytes = rows.numel()
        self._data[dest][offset : offset + nbytes].copy_(rows.view(-1))
        header[_READY + self.index] = seq

    def received(self, source: int, offset: int, nbytes: int, seq: int) -> torch.Tensor:
        """View of the nbytes member source put at offset of this rank's data area (waits for them).
        Valid until this rank calls done(seq)."""
        header = self._headers[self.index]
        self._wait(lambda: int(header[_READY + source]) == seq, source, "send its rows", seq)
        return self._data[self.index][offset : offset + nbytes]

    def done(self, seq: int) -> None:
        """This rank has read everything of exchange seq; senders may overwrite its data area."""
        self.completed = seq
        if self._headers:
            self._headers[self.index][_CONSUMED] = seq

    def mark_failed(self) -> None:
        """Tell the node peers, through this rank's header, that it failed: their waits for it end."""
        self._set_state(FAILED)

    def _set_state(self, state: int) -> None:
        self._state = state
        if self._headers:
            self._headers[self.index][_STATE] = state

    def _wait(self, ready, member: int, what: str, seq: int) -> None:
        if ready():
            return
        start = time.monotonic()
        deadline, next_liveness_check = start + self.timeout, start
        sleep = 0.0
        while not ready():
            now = time.monotonic()
            me, peer = self.group_ranks[self.index], self.group_ranks[member]
            if now >= next_liveness_check:
                gone = self._gone(member)
                if gone is not None:
                    raise PeerExitedError(
                        f"shared-memory exchange {seq}: rank {me} waited {now - start:.2f} s for rank {peer} to "
                        f"{what}, but rank {peer} {gone}; see rank {peer}'s own output for the cause")
                next_liveness_check = now + _LIVENESS_PERIOD_S
            if now > deadline:
                raise PeerTimeoutError(
                    f"shared-memory exchange {seq}: rank {me} waited {self.timeout:g} s for rank {peer} to {what}; "
                    f"rank {peer} hung, or runs a different sequence of MoE layers "
                    "(raise SHARDMOE_P2P_TIMEOUT_S to wait longer)"
                )
            # Yield first (the peer may be runnable on this core), then back off to at most 1 ms:
            # ranks routinely outnumber cores, and spinning would starve the peer we wait for.
            if sleep:
                time.sleep(sleep)
            else:
                os.sched_yield()
            sleep = min(max(2 * sleep, 1e-5), _MAX_POLL_SLEEP_S)

    def _gone(self, member: int) -> str | None:
        """Why member can no longer take part (its state word, or its process is gone), or None."""
        state = int(self._headers[member][_STATE])
        if state in _STATE_TEXT:
            return _STATE_TEXT[state]
        if member in self._peer_process:
            pid, start = self._peer_process[member]
            if _process_start(pid) != start:
                return f"exited (its process {pid} is gone)"
        return None


def _process_start(pid: int) -> int | None:
    """Start time of a running process (field 22 of /proc/<pid>/stat), or None when the process is
    gone, a zombie, or not visible from here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on; the name may hold spaces
    return None if fields[0] in ("Z", "X", "x") else int(fields[19])


def _mark_exiting(heap_ref) -> None:
    """atexit hook: tell the node peers this rank is going away (sys.last_value: it is leaving after
    an uncaught exception, which the interpreter has already printed)."""
    heap = heap_ref()
    if heap is not None and heap._state == RUNNING:
        heap._set_state(EXITING_AFTER_ERROR if getattr(sys, "last_value", None) is not None else EXITING)
