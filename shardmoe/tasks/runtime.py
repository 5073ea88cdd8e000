"""The runtime: `processors` workers per device run the queued tasks under a scheduler, in
logical time, and check the schedule's invariants as they go.

Event loop: every idle processor takes a pending task of its own device (the scheduler picks
which); the earliest-ending running task then completes: its kernel runs (its reads and writes
happen atomically at its end time), and the protocol bumps its counters, which may emit tasks.
The loop ends when nothing runs and nothing is pending.

Invariants, each raising ScheduleError that names the task and the counter or queue:
  - a sync counter never passes its threshold          (SyncCounters.add)
  - no queue overflows its computed capacity            (DeviceQueues.write_*)
  - every task is written once and runs exactly once    (Ledger)
  - at the end every used counter sits at its threshold (nothing was left waiting)
"""
from __future__ import annotations

import heapq

from shardmoe.tasks.kernels import KERNELS, KernelContext
from shardmoe.tasks.plan import Plan, Task
from shardmoe.tasks.queues import DeviceQueues, PtqLayout, ScheduleError, tq_capacity
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


def build_queues(plan: Plan, backward: bool, ledger: Ledger, gate_dependency: str = "token") -> list[DeviceQueues]:
    layout = PtqLayout(plan, backward, gate_dependency)
    slots = tq_capacity(plan, backward)
    return [DeviceQueues(d, slots, layout, plan.gtqcl, on_write=ledger.written) for d in range(plan.peers)]


def run_schedule(plan: Plan, queues: list[DeviceQueues], ledger: Ledger, protocol, ctx: KernelContext,
                 scheduler: Scheduler, processors: int, name: str) -> Trace:
    """Run every task the protocol emits to completion; returns the trace."""
    if isinstance(processors, bool) or not isinstance(processors, int) or processors < 1:
        raise ValueError(f"processors: expected an int >= 1, got {processors!r}")
    trace = Trace(name, plan.peers, processors, scheduler.name, [plan.node(d) for d in range(plan.peers)])
    idle = [[True] * processors for _ in range(plan.peers)]
    running: list[tuple[float, int, int, int, Task, float]] = []
    now, started = 0.0, 0
    while True:
        for device, dq in enumerate(queues):
            for proc in range(processors):
                if idle[device][proc] and dq.pending:
                    task = dq.pending.pop(scheduler.pick(dq.pending))
                    ledger.started(task)
                    idle[device][proc] = False
                    heapq.heappush(running, (now + scheduler.duration(task), started, device, proc, task, now))
                    started += 1
        if not running:
            break
        now, _, device, proc, task, start = heapq.heappop(running)
        KERNELS[task.type](task, ctx)
        ledger.finished(task)
        protocol.complete(task)
        idle[device][proc] = True
        trace.events.append(TraceEvent.of(task, proc, start, now))
        trace.signals += [Signal(now, h, kind, tile.device, tile.sync_idx) for h, kind, tile in protocol.signals]
        protocol.signals.clear()
    left = ledger.not_done()
    if left:
        raise ScheduleError(f"{len(left)} task(s) never ran, first {left[0]!r}")
    waiting = protocol.unfinished()
    if waiting:
        raise ScheduleError(f"schedule ended with counters short of their thresholds: {', '.join(waiting[:5])}")
    return trace
