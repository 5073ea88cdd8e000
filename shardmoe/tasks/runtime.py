"""The runtime: `processors` workers per device run the queued tasks under a scheduler, in
logical time, and check the schedule's invariants as they go.

Event loop: each device's scheduler polls its queues' tail and heads (QueueReader) and every idle
processor takes one announced signal (the scheduler picks which), decodes it and reads the task
from that slot; the task's kernel reads its inputs at that start time. Then the earliest event
happens: either a running task ends (its kernel writes its outputs, and the protocol bumps its
counters, which may emit tasks or post deliveries) or a delivery lands (a dispatch packet, a
flag, a heap put with its signal: the data lands and the receiving decoder runs). A delivery
takes scheduler.transfer(delivery, now) after it was posted (latency(remote) unless a cost
model prices its bytes and links: shardmoe/simulate/cost.py). The loop ends when nothing runs, nothing
is in flight and nothing is announced.

Invariants, each raising ScheduleError that names the task and the counter or queue:
  - a sync counter never passes its threshold          (SyncCounters.add)
  - no write lands outside a queue's allocation         (DeviceQueues.write_*)
  - every announced entry holds a task that belongs there, read once; no head announces more
    than its domain holds                                (QueueReader)
  - every task is written once and runs exactly once    (Ledger)
  - a task names no buffer of a device on another node  (_check_reach)
  - at the end every used counter sits at its threshold (nothing was left waiting)
"""
from __future__ import annotations

import heapq

from shardmoe.tasks.kernels import KERNELS, KernelContext
from shardmoe.tasks.plan import Plan, Ref, Task
from shardmoe.tasks.protocol import Delivery
from shardmoe.tasks.queues import DeviceQueues, PtqLayout, QueueReader, ScheduleError, tq_capacity
from shardmoe.tasks.schedulers import Scheduler
from shardmoe.tasks.trace import Signal, Trace, TraceEvent


class Ledger:
    """The write, start and finish of every task; uids are given in write order."""

    def __init__(self):
        self.tasks: list[Task] = []
        self.state: list[str] = []

    def written(self, task: Task) -> None:
        if task.uid != -1:
            raise ScheduleError(f"task {task!r} is written into a queue a second time")
        task.uid = len(self.tasks)
        self.tasks.append(task)
        self.state.append("queued")

    def _move(self, task: Task, before: str, after: str) -> None:
        if self.state[task.uid] != before:
            raise ScheduleError(f"task {task!r} is {self.state[task.uid]} where {before} was expected "
                                "(each task runs exactly once)")
        self.state[task.uid] = after

    def started(self, task: Task) -> None:
        self._move(task, "queued", "running")

    def finished(self, task: Task) -> None:
        self._move(task, "running", "done")

    def not_done(self) -> list[Task]:
        return [t for t, s in zip(self.tasks, self.state) if s != "done"]


def _check_reach(plan: Plan, task: Task) -> None:
    """A task may name its own device's buffers and, by P2P loads and stores, those of devices on
    its node; data of another node reaches it only through a heap cell of its own device."""
    for role, ref in task.operands.items():
        if isinstance(ref, Ref) and plan.is_remote(task.device, ref.device):
            raise ScheduleError(f"task {task!r} names {role}={ref.name} of device {ref.device} on another node "
                                "(remote data arrives only through a heap cell)")


def build_queues(plan: Plan, backward: bool, ledger: Ledger, gate_dependency: str = "token") -> list[DeviceQueues]:
    layout = PtqLayout(plan, backward, gate_dependency)
    slots = tq_capacity(plan, backward, gate_dependency)
    return [DeviceQueues(d, slots, layout, plan.gtqcl, on_write=ledger.written) for d in range(plan.peers)]


def run_schedule(plan: Plan, queues: list[DeviceQueues], ledger: Ledger, protocol, ctx: KernelContext,
                 scheduler: Scheduler, processors: int, name: str, start, kernels=None) -> Trace:
    """Run every task the protocol emits to completion; returns the trace.

    `kernels` (task type -> body, default KERNELS) lets shardmoe.simulate run this same loop
    without tensors: its bodies compute nothing and the scheduler's durations carry the costs.

    `start()` begins the pass (it posts the dispatch deliveries). The scheduler of each device
    reads its queues through a QueueReader built here with its own layout (same pass and gate
    mode as the writers'), never through the writers' bookkeeping."""
    if isinstance(processors, bool) or not isinstance(processors, int) or processors < 1:
        raise ValueError(f"processors: expected an int >= 1, got {processors!r}")
    writer = queues[0].layout
    readers = [QueueReader(dq, PtqLayout(plan, writer.backward, writer.gate_dependency)) for dq in queues]
    trace = Trace(name, plan.peers, processors, scheduler.name, [plan.node(d) for d in range(plan.peers)])
    idle = [[True] * processors for _ in range(plan.peers)]
    ready: list[list[int]] = [[] for _ in range(plan.peers)]  # announced signals not yet taken, per device
    events: list[tuple] = []  # (time, sequence, Delivery) or (time, sequence, (device, proc, task, start, commit))
    now, sequence = 0.0, 0
    kernels = KERNELS if kernels is None else kernels

    def post_deliveries() -> None:
        nonlocal sequence
        for delivery in protocol.outbox:
            heapq.heappush(events, (now + scheduler.transfer(delivery, now), sequence, delivery))
            sequence += 1
        protocol.outbox.clear()

    start()
    post_deliveries()
    while True:
        for device, reader in enumerate(readers):
            ready[device] += reader.poll()
            for proc in range(processors):
                if idle[device][proc] and ready[device]:
                    task = reader.read(ready[device].pop(scheduler.pick(ready[device])))
                    ledger.started(task)
                    _check_reach(plan, task)
                    commit = kernels[task.type](task, ctx)  # reads its inputs now, writes at its end
                    idle[device][proc] = False
                    heapq.heappush(events, (now + scheduler.duration(task), sequence, (device, proc, task, now, commit)))
                    sequence += 1
        if not events:
            break
        now, _, event = heapq.heappop(events)
        if isinstance(event, Delivery):
            event.land()
            trace.signals.append(Signal(now, event.device, event.kind, event.tile.device, event.tile.sync_idx))
        else:
            device, proc, task, began, commit = event
            commit()
            ledger.finished(task)
            protocol.complete(task)
            idle[device][proc] = True
            trace.events.append(TraceEvent.of(task, proc, began, now))
        post_deliveries()
    left = ledger.not_done()
    if left:
        raise ScheduleError(f"{len(left)} task(s) never ran, first {left[0]!r}")
    waiting = protocol.unfinished()
    if waiting:
        raise ScheduleError(f"schedule ended with counters short of their thresholds: {', '.join(waiting[:5])}")
    return trace
