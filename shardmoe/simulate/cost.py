"""The cost model: seconds for each tile task and each delivery of the tile runtime's schedule.

A simulated device stands for `gpus` real GPUs (1, or a whole node when aggregated: layout.py)
and runs `processors` simulated processors, each standing for gpus * sms / processors SMs. A
simulated row stands for `token_scale` real rows. Tasks cover the whole width of their operand
(coarse column tiles: Plan's block_n spans H and F), so a task of m simulated rows is
    u = ceil(m * token_scale / tile_rows) * ceil(width / 128)        real 128 x 128 output tiles,
each costing t_tile = 2 * tile_rows * 128 * K / (peak * efficiency / sms) on one SM (a partial
row tile costs a whole one); the task lasts ceil(u / SMs per processor) * t_tile (waves).

GEMM tiles (K the contraction, per real row tile, "glu"; "mlp" has one F-wide first GEMM):
  preGEMM       out 2F, K = H          postGEMM      out H,  K = F
  gradPostGEMM  out F,  K = H, twice (dA and dWdown)
  gradPreGEMM   out H,  K = 2F, twice (dx and dWgu)
  gradGateGEMM  out H,  K = E, twice (dx and dWg), per token tile
Elementwise tiles move bytes at HBM bandwidth in proportion to the SMs they hold: combine,
gradCombine, gradInputCombine 3 * rows * H * b; gradGateCombine 2 * rows * H * b.

Deliveries: a dispatch or a hand-back carries rows * H * b bytes (b = bytes per element; a P2P
hand-back only flags, and the combine then loads the same bytes over NVLink: they are charged to
the flag), a gate signal rows * 4 bytes. Same simulated device on one GPU: local, latency only;
within a node: NVLink; across nodes: the fabric. Each device has one egress and one ingress port
per link class of gpus * (per-GPU bandwidth); each port serves its transfers first come, first
served, each for bytes / bandwidth, and a transfer lands one latency after the later of its two
ports has passed it (that queueing is the contention).
"""
from __future__ import annotations

import math
from collections import defaultdict

from shardmoe.tasks.plan import Plan, Task, TaskType
from shardmoe.tasks.schedulers import Scheduler

from .presets import Hardware

COLUMN_TILE = 128
GEMM_TASKS = (TaskType.preGEMM, TaskType.postGEMM, TaskType.gradPostGEMM, TaskType.gradPreGEMM,
              TaskType.gradGateGEMM)
ELEMENTWISE_PASSES = {TaskType.combine: 3, TaskType.gradCombine: 3, TaskType.gradInputCombine: 3,
                      TaskType.gradGateCombine: 2}


class CostScheduler(Scheduler):
    """FIFO task choice (the tile runtime's default) with durations and transfers priced in seconds.
    Keeps the totals the report needs: useful FLOPs, busy seconds per device, bytes per link class."""

    name = "cost"

    def __init__(self, plan: Plan, hardware: Hardware, *, gpus: int, token_scale: int, processors: int):
        self.plan, self.hw, self.gpus, self.scale = plan, hardware, gpus, token_scale
        config = plan.config
        self.H, self.F, self.E = config.hidden_size, config.ffn_size, config.num_experts
        self.up_width = config.kind.up_width(self.F)
        self.sms_per_processor = gpus * hardware.sms / processors
        self.flops = 0.0  # useful FLOPs (real rows, no padding)
        self.busy = defaultdict(float)  # device -> processor-seconds
        self.link_bytes = {"local": 0.0, "nvlink": 0.0, "fabric": 0.0}
        self.port_free: dict[tuple, float] = defaultdict(float)  # (device, direction, class) -> free at
        self.port_busy: dict[tuple, float] = defaultdict(float)  # (device, direction, class) -> busy seconds

    # --- tasks ---------------------------------------------------------------------------------
    def _gemm(self, rows: int, width: int, contraction: int, repeats: int) -> float:
        hw = self.hw
        tiles = math.ceil(rows / hw.tile_rows) * math.ceil(width / COLUMN_TILE) * repeats
        tile_seconds = 2 * hw.tile_rows * COLUMN_TILE * contraction / (hw.peak_flops * hw.gemm_efficiency / hw.sms)
        self.flops += 2.0 * rows * width * contraction * repeats
        return math.ceil(tiles / self.sms_per_processor) * tile_seconds

    def duration(self, task: Task) -> float:
        kind = task.type
        if kind == TaskType.gradGateGEMM:
            tokens = self.plan.token_tile_at[(task.device, task.sync_idx)].tokens.numel() \
                if task.expert == -1 else self.plan.row_tile_of(task).size
            seconds = self._gemm(tokens * self.scale, self.H, self.E, 2)
        else:
            rows = self.plan.row_tile_of(task).size * self.scale
            if kind == TaskType.preGEMM:
                seconds = self._gemm(rows, self.up_width, self.H, 1)
            elif kind == TaskType.postGEMM:
                seconds = self._gemm(rows, self.H, self.F, 1)
            elif kind == TaskType.gradPostGEMM:
                seconds = self._gemm(rows, self.F, self.H, 2)
            elif kind == TaskType.gradPreGEMM:
                seconds = self._gemm(rows, self.H, self.up_width, 2)
            else:
                moved = ELEMENTWISE_PASSES[kind] * rows * self.H * self.hw.bytes_per_element
                seconds = moved / (self.hw.hbm_bandwidth * self.sms_per_processor / self.hw.sms)
        self.busy[task.device] += seconds
        return seconds

    # --- deliveries ----------------------------------------------------------------------------
    def link_class(self, source: int, destination: int) -> str:
        if source == destination:
            return "local" if self.gpus == 1 else "nvlink"
        return "fabric" if self.plan.is_remote(source, destination) else "nvlink"

    def transfer(self, delivery, now: float) -> float:
        tile = delivery.tile
        destination = delivery.device
        source = tile.peer if destination == tile.device else tile.device
        rows = tile.size * self.scale
        size = rows * 4 if delivery.kind == "gate signal" else rows * self.H * self.hw.bytes_per_element
        link = self.link_class(source, destination)
        self.link_bytes[link] += size
        if link == "local":
            return size / self.hw.hbm_bandwidth
        hw = self.hw
        bandwidth = self.gpus * (hw.fabric_bandwidth if link == "fabric" else hw.nvlink_bandwidth)
        latency = hw.fabric_latency if link == "fabric" else hw.nvlink_latency
        seconds = size / bandwidth
        ends = []
        for port in ((source, "out", link), (destination, "in", link)):  # each port queues on its own
            self.port_free[port] = max(now, self.port_free[port]) + seconds
            self.port_busy[port] += seconds
            ends.append(self.port_free[port])
        return max(ends) + latency - now

    def port_seconds(self) -> dict[str, float]:
        """The busiest port's busy seconds per link class."""
        out = {"nvlink": 0.0, "fabric": 0.0}
        for (_, _, link), busy in self.port_busy.items():
            out[link] = max(out[link], busy)
        return out
