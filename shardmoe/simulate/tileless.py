"""Run a Plan's forward or backward through shardmoe.tasks' own runtime without tensors.

Everything that decides the schedule is the tile runtime's: Plan (tiles, syncIdx), Emitters
(who writes which task where), DeviceQueues and QueueReader (tQ, ptQ, heads), SyncCounters and
thresholds, the protocols (deliveries, decoders) and run_schedule (the event loop, its ledger
and invariants). Only two things are swapped: the task bodies (KERNELS) become no-ops, and the
memory holds nothing (NO_DATA stands for every buffer). So the task counts, the dependency order
and, for the same scheduler and seed, the timeline are those of shardmoe.tasks.run_forward /
run_backward on the same routing (tests/simulate/test_tileless.py checks this).
"""
from __future__ import annotations

from shardmoe.tasks.api import _check_counts, _counted
from shardmoe.tasks.emitters import Emitters
from shardmoe.tasks.kernels import KernelContext
from shardmoe.tasks.plan import Plan, TaskType, backward_task_counts, forward_task_counts
from shardmoe.tasks.protocol import BackwardProtocol, ForwardProtocol
from shardmoe.tasks.runtime import Ledger, build_queues, run_schedule
from shardmoe.tasks.schedulers import Scheduler
from shardmoe.tasks.trace import Trace


class _NoData:
    """Stands for any tensor the protocol reads, slices, copies or writes into; holds nothing."""

    dtype = None

    def __getitem__(self, key) -> "_NoData":
        return self

    def __setitem__(self, key, value) -> None:
        pass

    def clone(self) -> "_NoData":
        return self


NO_DATA = _NoData()


class NoMemory:
    """The Memory interface (get, set, zeros by Ref) with no contents: a simulated run moves no data."""

    def __getitem__(self, ref) -> _NoData:
        return NO_DATA

    def __setitem__(self, ref, value) -> None:
        pass

    def zeros(self, ref, shape, dtype) -> _NoData:
        return NO_DATA


def _no_commit() -> None:
    pass


def _no_body(task, ctx):
    return _no_commit


NO_KERNELS = {kind: _no_body for kind in TaskType}


def simulate_forward(plan: Plan, scheduler: Scheduler, processors: int) -> tuple[Trace, dict[str, int]]:
    """The forward's trace and task counts (checked against the closed form), as run_forward."""
    ledger, memory = Ledger(), NoMemory()
    queues = build_queues(plan, False, ledger)
    protocol = ForwardProtocol(plan, memory, Emitters(plan, queues))
    trace = run_schedule(plan, queues, ledger, protocol, KernelContext(plan, memory, {}), scheduler, processors,
                         "forward", lambda: protocol.start(NO_DATA), kernels=NO_KERNELS)
    counts = _counted(ledger)
    _check_counts(counts, forward_task_counts(plan), "forward")
    return trace, counts


def simulate_backward(plan: Plan, scheduler: Scheduler, processors: int,
                      gate_dependency: str = "token") -> tuple[Trace, dict[str, int]]:
    """The backward's trace and task counts (checked against the closed form), as run_backward."""
    ledger, memory = Ledger(), NoMemory()
    queues = build_queues(plan, True, ledger, gate_dependency)
    protocol = BackwardProtocol(plan, memory, Emitters(plan, queues, gate_dependency), gate_dependency)
    trace = run_schedule(plan, queues, ledger, protocol, KernelContext(plan, memory, {}), scheduler, processors,
                         "backward", lambda: protocol.start(NO_DATA, NO_DATA, memory, {}), kernels=NO_KERNELS)
    counts = _counted(ledger)
    _check_counts(counts, backward_task_counts(plan, gate_dependency), "backward")
    return trace, counts
