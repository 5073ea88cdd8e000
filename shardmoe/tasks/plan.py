"""The tile plan of one MoE forward/backward: devices, row tiles, token tiles, Task records,
and the closed-form task counts.

Devices (FlashMoE's peers): `peers` simulated devices, grouped into nodes of `ranks_per_node`
consecutive ranks. Device d holds the experts [d*nLx, (d+1)*nLx) (nLx = E / peers) and the
tokens of its contiguous block of the S tokens (torch.tensor_split sizes). Two devices on one
node are P2P (NVLink: direct loads and stores, flags); devices on different nodes are remote
(NVSHMEM: puts into heap cells with a signal).

Row tiles. The kept (token, expert) pairs of the layer's own routing are grouped by
(home peer p, expert e) in token order; each group of m_pe rows is cut into
ceil(m_pe / block_m) row tiles of at most block_m rows. A row tile lives on the expert's device
under the sync index
    syncIdx = (p * nLx + local_expert) * TCM + tile,      TCM = ceil(C / block_m)
where C bounds the rows one peer can send one expert (its token count, or the capacity EC).
Column tiles: tN = ceil(P / block_n) over the expert intermediate dim (F for "glu"),
tNx = ceil(H / block_n) over the hidden dim.

Token tiles. Device d's tokens in blocks of block_m: the unit of gradGateGEMM (one token's
gate gradient needs all of its pairs, so it is planned per token, not per row tile).

Task counts (R = number of row tiles = sum_pe ceil(m_pe / block_m), G = number of token tiles):
    forward:  preGEMM R*tN, postGEMM R*tNx, combine R*tNx
    backward: gradCombine R*tNx, gradGateCombine R, gradPostGEMM R*tN, gradPreGEMM R*tNx,
              gradInputCombine R*tNx,
              gradGateGEMM G*tNx (per-token dependency) or R*tNx (row-tile mode)
"""
from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

import torch

from shardmoe.moe.config import MoEConfig
from shardmoe.moe.routing import Routing


class TaskType(str, enum.Enum):
    """The tile tasks, named as in FlashMoE: three forward, six backward (docs/tasks.md)."""

    preGEMM = "preGEMM"
    postGEMM = "postGEMM"
    combine = "combine"
    gradCombine = "gradCombine"
    gradGateCombine = "gradGateCombine"
    gradPostGEMM = "gradPostGEMM"
    gradPreGEMM = "gradPreGEMM"
    gradInputCombine = "gradInputCombine"
    gradGateGEMM = "gradGateGEMM"

    def __str__(self) -> str:
        return self.value


# Gate-gradient dependency modes: "token" waits for every kept pair of every token of a token tile
# (exact under any order); "row_tile" is FlashMoE's per-row-tile threshold (racy for top_k > 1).
GATE_DEPENDENCIES = ("token", "row_tile")


@dataclass(frozen=True)
class Ref:
    """An operand: buffer `name` (at `key`, if the buffer is keyed) in the memory of `device`.

    The runtime resolves it; a task on device a that names device b != a reads b's memory
    directly (a P2P load) -- remote data only ever arrives through a heap cell of its own device."""

    device: int
    name: str
    key: object = None


@dataclass(eq=False)
class Task:
    """One tile task, as in FlashMoE's Task record.

    type      the TaskType
    device    the device whose processors run it
    sync_idx  row tile (syncIdx on the expert's device) or token tile index (gradGateGEMM, "token")
    tile_idx  column tile only (rows are baked into the operands, as in FlashMoE's backward)
    expert    global expert index (-1 for gradGateGEMM of a token tile)
    peer      home device of the tile's tokens
    operands  role -> Ref (FlashMoE's aData/bData/cData/dData, by name)
    remote    FlashMoE's isPeerRemote: the expert and the tokens are on different nodes
    emitter   who created it (initial decoder, notifyGradient, ...), for errors and traces
    """

    type: TaskType
    device: int
    sync_idx: int
    tile_idx: int
    expert: int
    peer: int
    operands: dict = field(default_factory=dict)
    remote: bool = False
    emitter: str = ""
    uid: int = -1  # set when a queue takes the task, in write order

    def __repr__(self) -> str:
        return (f"{self.type}(device={self.device}, syncIdx={self.sync_idx}, tileIdx={self.tile_idx}, "
                f"expert={self.expert}, peer={self.peer}, uid={self.uid}, from {self.emitter})")


@dataclass(frozen=True, eq=False)
class RowTile:
    """Row tile `tile` of the (peer, expert) group, on the expert's device: m <= block_m
    consecutive rows with tokens [m] (global indices), pairs [m] (t * k + j) and weights w [m]."""

    device: int
    sync_idx: int
    peer: int
    expert: int
    local_expert: int
    tile: int
    tokens: torch.Tensor
    pairs: torch.Tensor
    weight: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.numel())


@dataclass(frozen=True, eq=False)
class TokenTile:
    """Tokens [m] (global indices, contiguous) of device `device`, the index-th block of block_m."""

    device: int
    index: int
    tokens: torch.Tensor


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


class Plan:
    """Tiles of one routed batch: built from the layer's own Routing, so the tasks reproduce the
    single-process layer exactly (capacity drops included)."""

    def __init__(self, config: MoEConfig, routing: Routing, num_tokens: int, *, peers: int = 1,
                 ranks_per_node: int | None = None, block_m: int = 8, block_n: int = 8):
        for name, value in (("peers", peers), ("block_m", block_m), ("block_n", block_n)):
            _positive(name, value)
        if ranks_per_node is not None:
            _positive("ranks_per_node", ranks_per_node)
        if config.num_experts % peers:
            raise ValueError(f"peers: expected a divisor of num_experts={config.num_experts} (experts split "
                             f"in equal contiguous blocks), got {peers}")
        self.config, self.routing, self.num_tokens = config, routing, num_tokens
        self.peers, self.ranks_per_node = peers, ranks_per_node or peers
        self.block_m, self.block_n = block_m, block_n
        self.local_experts = config.num_experts // peers
        self.tn = math.ceil(config.ffn_size / block_n)
        self.tnx = math.ceil(config.hidden_size / block_n)
        sizes = [len(b) for b in torch.arange(num_tokens).tensor_split(peers)]
        starts = [0, *itertools.accumulate(sizes)]
        self.token_range = [(starts[d], starts[d + 1]) for d in range(peers)]
        capacity = config.capacity(num_tokens)
        rows_bound = max(sizes) if capacity is None else min(max(sizes), capacity)
        self.tcm = max(1, math.ceil(rows_bound / block_m))
        self.token_tiles = [TokenTile(d, g, torch.arange(lo, hi)[g * block_m:(g + 1) * block_m])
                            for d, (lo, hi) in enumerate(self.token_range)
                            for g in range(math.ceil((hi - lo) / block_m))]
        max_token_tiles = math.ceil(max(sizes) / block_m)
        # gtQCl row-tile slots per device; the token tiles' gradGateGEMM share the slot numbering.
        self.gtqcl = max(peers * self.local_experts * self.tcm, max_token_tiles)
        self.row_tiles = self._row_tiles()
        self.row_tile_at = {(t.device, t.sync_idx): t for t in self.row_tiles}
        self.token_tile_at = {(t.device, t.index): t for t in self.token_tiles}
        k = config.top_k
        self.kept_pairs = torch.bincount(routing.row_pair // k, minlength=num_tokens)

    def _row_tiles(self) -> list[RowTile]:
        routing, k, bm = self.routing, self.config.top_k, self.block_m
        expert_of_row = routing.top_idx.reshape(-1)[routing.row_pair]
        weights = routing.weight.reshape(-1)
        tiles = []
        for e in range(self.config.num_experts):
            pairs_e = routing.row_pair[expert_of_row == e]
            device, local = divmod(e, self.local_experts)
            for p in range(self.peers):
                lo, hi = self.token_range[p]
                tokens_e = pairs_e // k
                pairs = pairs_e[(tokens_e >= lo) & (tokens_e < hi)]
                for tile in range(math.ceil(pairs.numel() / bm)):
                    chunk = pairs[tile * bm:(tile + 1) * bm]
                    sync = (p * self.local_experts + local) * self.tcm + tile
                    tiles.append(RowTile(device, sync, p, e, local, tile, chunk // k, chunk, weights[chunk]))
        return tiles

    # --- topology ----------------------------------------------------------------------------
    def node(self, device: int) -> int:
        return device // self.ranks_per_node

    def is_remote(self, a: int, b: int) -> bool:
        """Devices on different nodes talk through NVSHMEM heap cells; on one node, P2P."""
        return self.node(a) != self.node(b)

    def row_tile_of(self, task: Task) -> RowTile:
        """The row tile a task works on, wherever it runs: its syncIdx lives on the expert's device."""
        return self.row_tile_at[(task.expert // self.local_experts, task.sync_idx)]

    def local_tokens(self, tokens: torch.Tensor, device: int) -> torch.Tensor:
        """Global token indices -> row indices in device's token block."""
        return tokens - self.token_range[device][0]

    def columns(self, tile_idx: int, size: int) -> slice:
        return slice(tile_idx * self.block_n, min((tile_idx + 1) * self.block_n, size))


def forward_task_counts(plan: Plan) -> dict[TaskType, int]:
    """Closed-form forward counts: per row tile tN preGEMM, tNx postGEMM, tNx combine."""
    rows = len(plan.row_tiles)
    return {TaskType.preGEMM: rows * plan.tn, TaskType.postGEMM: rows * plan.tnx,
            TaskType.combine: rows * plan.tnx}


def backward_task_counts(plan: Plan, gate_dependency: str = "token",
                         final_gate_combine: bool = False) -> dict[TaskType, int]:
    """Closed-form backward counts (module docstring). `final_gate_combine` adds the second
    gradGateCombine per row tile that FlashMoE forbids, emitted by the final decoder."""
    rows, tn, tnx = len(plan.row_tiles), plan.tn, plan.tnx
    gate_units = len(plan.token_tiles) if gate_dependency == "token" else rows
    return {TaskType.gradCombine: rows * tnx,
            TaskType.gradGateCombine: rows * (2 if final_gate_combine else 1),
            TaskType.gradPostGEMM: rows * tn,
            TaskType.gradPreGEMM: rows * tnx,
            TaskType.gradInputCombine: rows * tnx,
            TaskType.gradGateGEMM: gate_units * tnx}
