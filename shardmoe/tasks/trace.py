"""The trace of one run: each task's logical start and end and the processor that ran it, plus
the signals (flags, heap signals) between devices; exported as Chrome trace JSON (opens in
Perfetto or chrome://tracing) and as a PNG Gantt chart coloured by task type.

Chrome trace: {"traceEvents": [...]} with one complete event per task
    {"ph": "X", "name": type, "ts": start, "dur": end - start, "pid": device, "tid": processor,
     "args": {syncIdx, tileIdx, expert, peer, uid, emitter, remote}}
an instant event ("ph": "i") per signal, and process/thread name metadata ("ph": "M").
One logical time unit is written as 1000 us, so a GEMM tile (4 units) shows as 4 ms.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shardmoe.tasks.plan import Task, TaskType

US_PER_UNIT = 1000.0

SIGNAL_COLOURS = {"flag": "black", "heap signal": "#9467bd", "gate signal": "#8c564b"}

COLOURS = {
    TaskType.preGEMM: "#1f77b4", TaskType.postGEMM: "#ff7f0e", TaskType.combine: "#2ca02c",
    TaskType.gradCombine: "#17becf", TaskType.gradGateCombine: "#bcbd22", TaskType.gradPostGEMM: "#ff7f0e",
    TaskType.gradPreGEMM: "#1f77b4", TaskType.gradInputCombine: "#2ca02c", TaskType.gradGateGEMM: "#d62728",
}


@dataclass(frozen=True)
class TraceEvent:
    type: str
    device: int
    processor: int
    start: float
    end: float
    sync_idx: int
    tile_idx: int
    expert: int
    peer: int
    uid: int
    emitter: str
    remote: bool

    @classmethod
    def of(cls, task: Task, processor: int, start: float, end: float) -> "TraceEvent":
        return cls(str(task.type), task.device, processor, start, end, task.sync_idx, task.tile_idx, task.expert,
                   task.peer, task.uid, task.emitter, task.remote)


@dataclass(frozen=True)
class Signal:
    """At `time`, device `device` learnt that row tile `sync_idx` of expert device `source` is done."""

    time: float
    device: int
    kind: str
    source: int
    sync_idx: int


@dataclass
class Trace:
    name: str
    peers: int
    processors: int
    scheduler: str
    nodes: list[int]  # node of each device
    events: list[TraceEvent] = field(default_factory=list)
    signals: list[Signal] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    def to_chrome(self) -> dict:
        out = []
        for d in range(self.peers):
            out.append({"ph": "M", "name": "process_name", "pid": d, "tid": 0, "args": {"name": f"device {d} (node {self.nodes[d]})"}})
            for p in range(self.processors):
                out.append({"ph": "M", "name": "thread_name", "pid": d, "tid": p, "args": {"name": f"processor {p}"}})
        for e in self.events:
            args = {"syncIdx": e.sync_idx, "tileIdx": e.tile_idx, "expert": e.expert, "peer": e.peer, "uid": e.uid,
                    "emitter": e.emitter, "isPeerRemote": e.remote}
            out.append({"ph": "X", "name": e.type, "cat": self.name, "ts": e.start * US_PER_UNIT,
                        "dur": (e.end - e.start) * US_PER_UNIT, "pid": e.device, "tid": e.processor, "args": args})
        for s in self.signals:
            out.append({"ph": "i", "s": "p", "name": s.kind, "cat": self.name, "ts": s.time * US_PER_UNIT,
                        "pid": s.device, "tid": 0, "args": {"source": s.source, "syncIdx": s.sync_idx}})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"pass": self.name, "scheduler": self.scheduler, "time unit": "1 logical unit = 1 ms"}}

    def save_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome()))
        return path

    def save_png(self, path, title: str = "") -> Path:
        """Gantt chart: one row per (device, processor), one bar per task coloured by its type,
        ticks under a device's rows where a flag or heap signal reached it."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        path = Path(path)
        rows = self.peers * self.processors
        fig, ax = plt.subplots(figsize=(14, 1.2 + 0.32 * rows + 0.3 * self.peers))

        def row_of(device: int, processor: int) -> int:
            return rows - 1 - (device * self.processors + processor)

        for e in self.events:
            ax.barh(row_of(e.device, e.processor), e.end - e.start, left=e.start, height=0.8,
                    color=COLOURS[TaskType(e.type)], edgecolor="black", linewidth=0.3)
        for s in self.signals:
            ax.plot([s.time], [row_of(s.device, self.processors - 1) - 0.55], marker="^", markersize=4,
                    color=SIGNAL_COLOURS[s.kind], linestyle="none")
        for d in range(1, self.peers):
            ax.axhline(row_of(d, 0) + 0.5, color="grey", linewidth=0.8)
        ax.set_yticks([row_of(d, p) for d in range(self.peers) for p in range(self.processors)])
        ax.set_yticklabels([f"node {self.nodes[d]} dev {d} / proc {p}" for d in range(self.peers)
                            for p in range(self.processors)],
                           fontsize=7)
        ax.set_xlabel("logical time")
        ax.set_xlim(0, self.makespan * 1.01 or 1)
        ax.set_ylim(-0.9, rows - 0.4)
        present = sorted({e.type for e in self.events}, key=lambda t: list(TaskType).index(TaskType(t)))
        handles = [Patch(color=COLOURS[TaskType(t)], label=t) for t in present]
        kinds = sorted({s.kind for s in self.signals})
        handles += [plt.Line2D([], [], marker="^", color=SIGNAL_COLOURS[k], linestyle="none", label=f"{k} (arrival)")
                    for k in kinds]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        ax.set_title(title or f"{self.name}: {len(self.events)} tasks, {self.peers} devices x {self.processors} "
                              f"processors, {self.scheduler} scheduler", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
