"""Schedulers: which announced task an idle processor takes, and how long tasks and deliveries take.

Time is logical: a task of type T lasts COST[T] units (GEMM tiles 4, the gate GEMM 2, combines
and dot products 1). "fifo" takes the oldest announced signal of its device (in the order
QueueReader.poll found them), "lifo" the newest, "random" a uniformly chosen one and stretches each duration by a factor in [0.25, 1.75), both
from its own seeded generator, so one seed is one reproducible interleaving.
A delivery (dispatch packet, flag, heap put + signal) lands LATENCY[remote] units after it was
posted: 1 on one node (NVLink), 2 across nodes; "random" stretches it by the same factor range,
so packets arrive, and decoders fire, in varying orders.
"""
from __future__ import annotations

import random

from shardmoe.tasks.plan import Task, TaskType

COST = {
    TaskType.preGEMM: 4.0, TaskType.postGEMM: 4.0, TaskType.combine: 1.0,
    TaskType.gradCombine: 1.0, TaskType.gradGateCombine: 1.0, TaskType.gradPostGEMM: 4.0,
    TaskType.gradPreGEMM: 4.0, TaskType.gradInputCombine: 1.0, TaskType.gradGateGEMM: 2.0,
}

LATENCY = {False: 1.0, True: 2.0}  # by remote: P2P store + flag, or heap put + signal

SCHEDULERS = ("fifo", "lifo", "random")


class Scheduler:
    name = "fifo"

    def pick(self, announced: list[int]) -> int:
        """Index into `announced` (non-empty signals, in the order polling found them) of the next."""
        return 0

    def duration(self, task: Task) -> float:
        return COST[task.type]

    def latency(self, remote: bool) -> float:
        return LATENCY[remote]

    def transfer(self, delivery, now: float) -> float:
        """How long `delivery` (posted at `now`) takes to land: the logical latency of its link
        class here; a cost model (shardmoe.simulate.cost) prices its bytes and contention instead."""
        return self.latency(delivery.remote)


class LifoScheduler(Scheduler):
    name = "lifo"

    def pick(self, announced: list[int]) -> int:
        return len(announced) - 1


class RandomScheduler(Scheduler):
    name = "random"

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def pick(self, announced: list[int]) -> int:
        return self.rng.randrange(len(announced))

    def duration(self, task: Task) -> float:
        return COST[task.type] * self.rng.uniform(0.25, 1.75)

    def latency(self, remote: bool) -> float:
        return LATENCY[remote] * self.rng.uniform(0.25, 1.75)


def make_scheduler(name: str, seed: int = 0) -> Scheduler:
    if name == "fifo":
        return Scheduler()
    if name == "lifo":
        return LifoScheduler()
    if name == "random":
        return RandomScheduler(seed)
    raise ValueError(f"scheduler: expected one of {', '.join(SCHEDULERS)}, got {name!r}")
