"""Task queues and sync counters of one device, with the capacities they are allocated with.

tQ (the decoders' queue): a flat array of `capacity` Task slots, filled through one tail
counter; decoders (initial and final) write gradCombine, gradGateCombine, gradInputCombine
(backward) and preGEMM, combine (forward) into it.

ptQ (the processors' queue): gtQCl slots of `stride` Task entries, one slot per syncIdx:
    forward   stride TN + TNx:   postGEMM (TNx, notifyNext) at offset 0
    backward  stride TN + 2*TNx: gradPostGEMM (TN, notifyGradient) at 0,
                                 gradGateGEMM (TNx, notifyGateGradient) at TN,
                                 gradPreGEMM (TNx, notifyGradPreGEMM) at TN + TNx
Each (domain, slot) has a head tQH that counts the tasks written there; the scheduler learns
of new work by polling heads. Domains, as tQH indices:
    primary    tQH[s]            gradPostGEMM (+ gradGateGEMM in the seeds' row-tile mode)
    secondary  tQH[gtQCl + s]    gradPreGEMM: written later, by another processor (seeds)
    gate       tQH[2*gtQCl + g]  gradGateGEMM of token tile g (per-token mode): its producer is
                                 the token's gate counter, unrelated in time to slot g's GEMMs
A write past a domain's size, or past tQ's capacity, raises ScheduleError.

Sync counters (tQS and the gate counters) carry a threshold each; an increment past it raises
ScheduleError naming the task that did it and the counter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardmoe.tasks.plan import Plan, Task


class ScheduleError(RuntimeError):
    """A broken schedule invariant; the message names the task and the counter or queue."""


@dataclass(frozen=True)
class Domain:
    name: str
    head_base: int  # tQH index of slot 0
    offset: int     # entry offset inside a ptQ slot
    size: int       # entries this domain may hold per slot


class PtqLayout:
    """Stride and head domains of ptQ for one pass (and gate mode)."""

    def __init__(self, plan: Plan, backward: bool, gate_dependency: str = "token"):
        tn, tnx, g = plan.tn, plan.tnx, plan.gtqcl
        if not backward:
            self.stride = tn + tnx
            self.domains = {"primary": Domain("primary", 0, 0, tnx)}
            return
        self.stride = tn + 2 * tnx
        if gate_dependency == "row_tile":
            primary = Domain("primary", 0, 0, tn + tnx)
            self.domains = {"primary": primary, "secondary": Domain("secondary", g, tn + tnx, tnx)}
        else:
            self.domains = {"primary": Domain("primary", 0, 0, tn),
                            "secondary": Domain("secondary", g, tn + tnx, tnx),
                            "gate": Domain("gate", 2 * g, tn, tnx)}


def tq_capacity(plan: Plan, backward: bool) -> int:
    """tQ slots a device allocates, from the plan's bounds (not from this batch's routing):
    as expert device, every row-tile slot of its experts (peers * nLx * TCM) may arrive, each
    decoded into TN preGEMM (forward) or TNx gradCombine + 1 gradGateCombine (backward); as token
    device, every row tile of its tokens (E * TCM) may come back, each decoded into TNx combine or
    TNx gradInputCombine."""
    expert_slots = plan.peers * plan.local_experts * plan.tcm
    home_slots = plan.config.num_experts * plan.tcm
    initial = plan.tnx + 1 if backward else plan.tn
    return expert_slots * initial + home_slots * plan.tnx


class DeviceQueues:
    """tQ, ptQ and the heads of one device; `pending` is what the scheduler sees, in write order."""

    def __init__(self, device: int, tq_slots: int, layout: PtqLayout, gtqcl: int, on_write=lambda task: None):
        self.device, self.layout, self.gtqcl, self.on_write = device, layout, gtqcl, on_write
        self.tq: list[Task | None] = [None] * tq_slots
        self.tq_tail = 0
        self.ptq: list[Task | None] = [None] * (gtqcl * layout.stride)
        self.heads = [0] * (len(layout.domains) * gtqcl)
        self.pending: list[Task] = []

    def write_tq(self, task: Task) -> int:
        if self.tq_tail >= len(self.tq):
            raise ScheduleError(f"tQ of device {self.device} overflows its capacity {len(self.tq)} "
                                f"at task {task!r}")
        slot = self.tq_tail
        self.on_write(task)
        self.tq[slot] = task
        self.tq_tail += 1
        self.pending.append(task)
        return slot

    def write_ptq(self, task: Task, slot: int, domain: str) -> int:
        d = self.layout.domains[domain]
        if not 0 <= slot < self.gtqcl:
            raise ScheduleError(f"ptQ of device {self.device}: slot {slot} outside [0, gtQCl={self.gtqcl}) "
                                f"at task {task!r}")
        head = d.head_base + slot
        if self.heads[head] >= d.size:
            raise ScheduleError(f"ptQ of device {self.device}: {domain} domain tQH[{head}] overflows its "
                                f"{d.size} entries in slot {slot} at task {task!r}")
        index = slot * self.layout.stride + d.offset + self.heads[head]
        self.on_write(task)
        self.ptq[index] = task
        self.heads[head] += 1
        self.pending.append(task)
        return index


class SyncCounters:
    """Named counter arrays of one device, each entry with its threshold."""

    def __init__(self, device: int):
        self.device = device
        self.values: dict[str, torch.Tensor] = {}
        self.thresholds: dict[str, torch.Tensor] = {}
        self.labels: dict = {}

    def define(self, name: str, thresholds: torch.Tensor, initial: torch.Tensor | None = None,
               label=None) -> None:
        """A counter array; label(i) is how errors name entry i (default 'name[i]')."""
        self.thresholds[name] = thresholds.to(torch.int64)
        self.values[name] = torch.zeros_like(self.thresholds[name]) if initial is None else initial.to(torch.int64)
        self.labels[name] = label or (lambda i, name=name: f"{name}[{i}]")

    def add(self, name: str, index: int, task: Task | None, amount: int = 1) -> int:
        """counter[name][index] += amount; returns the new value; raises past the threshold."""
        values = self.values[name]
        value = int(values[index]) + amount
        limit = int(self.thresholds[name][index])
        if value > limit:
            who = repr(task) if task is not None else "a decoder"
            raise ScheduleError(f"counter {self.labels[name](index)} on device {self.device} passes its threshold "
                                f"{limit} (reaches {value}) at {who}")
        values[index] = value
        return value

    def unfinished(self, name: str, used: list[int]) -> list[str]:
        """'name[i]=v/threshold' for the used entries that did not reach their threshold."""
        v, t = self.values[name], self.thresholds[name]
        label = self.labels[name]
        return [f"{label(i)}={int(v[i])}/{int(t[i])} on device {self.device}" for i in used if v[i] != t[i]]
