"""Schedulers: which pending task an idle processor takes, and how long a task takes.

Time is logical: a task of type T lasts COST[T] units (GEMM tiles 4, the gate GEMM 2, combines
and dot products 1). "fifo" takes the oldest pending task of its device, "lifo" the newest,
"random" a uniformly chosen one and stretches each duration by a factor in [0.25, 1.75), both
from its own seeded generator, so one seed is one reproducible interleaving.
"""
from __future__ import annotations

import random

from shardmoe.tasks.plan import Task, TaskType

COST = {
    TaskType.preGEMM: 4.0, TaskType.postGEMM: 4.0, TaskType.combine: 1.0,
    TaskType.gradCombine: 1.0, TaskType.gradGateCombine: 1.0, TaskType.gradPostGEMM: 4.0,
    TaskType.gradPreGEMM: 4.0, TaskType.gradInputCombine: 1.0, TaskType.gradGateGEMM: 2.0,
}

SCHEDULERS = ("fifo", "lifo", "random")


class Scheduler:
    name = "fifo"

    def pick(self, pending: list[Task]) -> int:
        """Index into `pending` (non-empty, in write order) of the task to run next."""
        return 0

    def duration(self, task: Task) -> float:
        return COST[task.type]


class LifoScheduler(Scheduler):
    name = "lifo"

    def pick(self, pending: list[Task]) -> int:
        return len(pending) - 1


class RandomScheduler(Scheduler):
    name = "random"

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def pick(self, pending: list[Task]) -> int:
        return self.rng.randrange(len(pending))

    def duration(self, task: Task) -> float:
        return COST[task.type] * self.rng.uniform(0.25, 1.75)


def make_scheduler(name: str, seed: int = 0) -> Scheduler:
    if name == "fifo":
        return Scheduler()
    if name == "lifo":
        return LifoScheduler()
    if name == "random":
        return RandomScheduler(seed)
    raise ValueError(f"scheduler: expected one of {', '.join(SCHEDULERS)}, got {name!r}")
