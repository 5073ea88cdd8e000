"""Task queues and sync counters of one device, with the capacities they are allocated with.

tQ (the decoders' queue): a flat array of `capacity` Task slots, filled through one tail
counter; decoders (initial and final) write gradCombine, gradGateCombine, gradInputCombine
(backward) and preGEMM, combine (forward) into it.

ptQ (the processors' queue): gtQCl slots of `stride` Task entries, one slot per syncIdx:
    forward   stride TN + TNx:   postGEMM (TNx, notifyNext) at offset 0
    backward  stride TN + 2*TNx: gradPostGEMM (TN, notifyGradient) at 0,
                                 gradGateGEMM (TNx, notifyGateGradient) at TN,
                                 gradPreGEMM (TNx, notifyGradPreGEMM) at TN + TNx
Each (domain, slot) has a head tQH that counts the tasks written there. Domains, as tQH indices:
    primary    tQH[s]            gradPostGEMM
    secondary  tQH[gtQCl + s]    gradPreGEMM: written later, by another processor (as in FlashMoE)
    gate       tQH[2*gtQCl + g]  gradGateGEMM of token tile g (per-token mode): its producer is
                                 the token's gate counter, unrelated in time to slot g's GEMMs
The writers (DeviceQueues.write_*) compute an entry's index from their layout and bump a head or
the tail; like a kernel's stores they check only that the index lies inside the allocation (tQ's
capacity, ptQ's gtQCl * stride entries). The scheduler (QueueReader) learns of work ONLY by
polling the tail and the heads, and decodes each new entry with its own blockQStride and domain
table, so a writer/reader mismatch (stride, domain, slot collision) surfaces as a ScheduleError
naming the slot, as it would surface as a wrong task on a GPU.

Sync counters (tQS and the gate counters) carry a threshold each; an increment past it raises
ScheduleError naming the task that did it and the counter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardmoe.tasks.plan import Plan, Task, TaskType


class ScheduleError(RuntimeError):
    """A broken schedule invariant; the message names the task and the counter or queue."""


@dataclass(frozen=True)
class Domain:
    name: str
    head_base: int  # tQH index of slot 0
    offset: int     # entry offset inside a ptQ slot
    size: int       # entries this domain may hold per slot


class PtqLayout:
    """Stride and head domains of ptQ for one pass (and gate mode), the task type each entry
    offset of a slot holds (`entry_types`, None where nothing goes) and the types tQ holds."""

    def __init__(self, plan: Plan, backward: bool, gate_dependency: str = "token"):
        tn, tnx, g = plan.tn, plan.tnx, plan.gtqcl
        self.gtqcl, self.backward, self.gate_dependency = g, backward, gate_dependency
        if not backward:
            self.stride = tn + tnx
            self.domains = {"primary": Domain("primary", 0, 0, tnx)}
            self.entry_types = [TaskType.postGEMM] * tnx + [None] * tn
            self.tq_types = (TaskType.preGEMM, TaskType.combine)
            return
        self.stride = tn + 2 * tnx
        self.entry_types = [TaskType.gradPostGEMM] * tn + [TaskType.gradGateGEMM] * tnx + [TaskType.gradPreGEMM] * tnx
        self.tq_types = (TaskType.gradCombine, TaskType.gradGateCombine, TaskType.gradInputCombine)
        if gate_dependency == "row_tile":  # the token device's gate decoder writes gradGateGEMM into tQ
            self.tq_types += (TaskType.gradGateGEMM,)
        if gate_dependency == "row_tile":
            self.domains = {"primary": Domain("primary", 0, 0, tn), "secondary": Domain("secondary", g, tn + tnx, tnx)}
        else:
            self.domains = {"primary": Domain("primary", 0, 0, tn),
                            "secondary": Domain("secondary", g, tn + tnx, tnx),
                            "gate": Domain("gate", 2 * g, tn, tnx)}


def tq_capacity(plan: Plan, backward: bool, gate_dependency: str = "token") -> int:
    """tQ slots a device allocates, from the plan's bounds (not from this batch's routing):
    as expert device, every row-tile slot of its experts (peers * nLx * TCM) may arrive, each
    decoded into TN preGEMM (forward) or TNx gradCombine + 1 gradGateCombine (backward); as token
    device, every row tile of its tokens (E * TCM) may come back, each decoded into TNx combine or
    TNx gradInputCombine, plus TNx gradGateGEMM in the row-tile gate mode."""
    expert_slots = plan.peers * plan.local_experts * plan.tcm
    home_slots = plan.config.num_experts * plan.tcm
    initial = plan.tnx + 1 if backward else plan.tn
    returned = 2 * plan.tnx if backward and gate_dependency == "row_tile" else plan.tnx
    return expert_slots * initial + home_slots * returned


class DeviceQueues:
    """tQ, ptQ, tQ's tail and the tQH heads of one device, as the writers fill them. `layout` is
    the WRITERS' layout; the scheduler reads with a QueueReader holding its own."""

    def __init__(self, device: int, tq_slots: int, layout: PtqLayout, gtqcl: int, on_write=lambda task: None):
        self.device, self.layout, self.gtqcl, self.on_write = device, layout, gtqcl, on_write
        self.tq: list[Task | None] = [None] * tq_slots
        self.tq_tail = 0
        self.ptq: list[Task | None] = [None] * (gtqcl * layout.stride)
        self.heads = [0] * (len(layout.domains) * gtqcl)
        self.moved_heads: set[int] = set()  # heads written since the reader last looked (its doorbell)

    def write_tq(self, task: Task) -> int:
        if self.tq_tail >= len(self.tq):
            raise ScheduleError(f"tQ of device {self.device} overflows its capacity {len(self.tq)} "
                                f"at task {task!r}")
        slot = self.tq_tail
        self.on_write(task)
        self.tq[slot] = task
        self.tq_tail += 1
        return slot

    def write_ptq(self, task: Task, slot: int, domain: str) -> int:
        d = self.layout.domains[domain]
        if not 0 <= slot < self.gtqcl:
            raise ScheduleError(f"ptQ of device {self.device}: slot {slot} outside [0, gtQCl={self.gtqcl}) "
                                f"at task {task!r}")
        head = d.head_base + slot
        index = slot * self.layout.stride + d.offset + self.heads[head]
        if index >= len(self.ptq):
            raise ScheduleError(f"ptQ of device {self.device}: entry {index} of slot {slot} ({domain} domain "
                                f"tQH[{head}]) lies past its {len(self.ptq)} entries at task {task!r}")
        self.on_write(task)
        self.ptq[index] = task
        self.heads[head] += 1
        self.moved_heads.add(head)
        return index


class QueueReader:
    """The scheduler's side of one device's queues, independent of the writers' index computation.

    poll() walks what it has not consumed yet: tQ's tail, then every tQH[h] that moved (the writer
rings a doorbell naming the head, so a poll costs what was written, not the number of heads) (domain D = h // gtQCl,
    slot s = h % gtQCl) and turns each new entry into a signal, as FlashMoE's scheduler does:
        tQ entry i                    signal = i                                   (< sT)
        j-th entry of tQH[h]          signal = sT + s * blockQStride + D.offset + j  (>= sT)
    read(signal) is the processor's decode: signal >= sT means ptQ[signal - sT]; it returns the
    task there, or raises ScheduleError naming the slot if the entry is empty, already consumed,
    or holds a task whose type, device or syncIdx does not belong there, or if a head announces
    more entries than its domain holds."""

    def __init__(self, queues: DeviceQueues, layout: PtqLayout):
        self.queues, self.layout, self.stride = queues, layout, layout.stride
        self.domain_at = {d.head_base // layout.gtqcl: d for d in layout.domains.values()}
        self.tail_seen = 0
        self.heads_seen = [0] * (len(layout.domains) * layout.gtqcl)
        self.consumed: set[int] = set()

    def poll(self) -> list[int]:
        """Signals of the entries written since the last poll: tQ in tail order, then head by head."""
        q, g, st = self.queues, self.layout.gtqcl, len(self.queues.tq)
        signals = list(range(self.tail_seen, q.tq_tail))
        self.tail_seen = q.tq_tail
        # the doorbell says which heads moved; they are read in ascending order, as a full scan would
        moved, q.moved_heads = sorted(q.moved_heads), set()
        for h in moved:
            seen, count = self.heads_seen[h], q.heads[h]
            if count == seen:
                continue
            domain, slot = self.domain_at[h // g], h % g
            if count > domain.size:
                raise ScheduleError(f"ptQ of device {q.device}, slot {slot}: tQH[{h}] ({domain.name} domain) "
                                    f"announces {count} entries, the domain holds {domain.size}")
            signals += [st + slot * self.stride + domain.offset + j for j in range(seen, count)]
            self.heads_seen[h] = count
        return signals

    def read(self, signal: int) -> Task:
        q, st = self.queues, len(self.queues.tq)
        if signal < st:
            where, task, want, slot = f"tQ slot {signal}", q.tq[signal], self.layout.tq_types, None
        else:
            index = signal - st
            slot, offset = divmod(index, self.stride)
            where = f"ptQ slot {slot} (entry {offset}, signal {signal})"
            task, want = q.ptq[index] if index < len(q.ptq) else None, (self.layout.entry_types[offset],)
        where = f"{where} of device {q.device}"
        if task is None:
            raise ScheduleError(f"{where} is empty where a head announced a task")
        if signal in self.consumed:
            raise ScheduleError(f"{where} was already consumed: two announced entries decode to it, {task!r}")
        if task.type not in want or task.device != q.device or (slot is not None and task.sync_idx != slot):
            raise ScheduleError(f"{where} holds {task!r}, which does not belong there (expected "
                                f"{' or '.join(map(str, want))} of device {q.device}"
                                + (f", syncIdx {slot})" if slot is not None else ")"))
        self.consumed.add(signal)
        return task


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
