"""The schedule's rules: what starts a pass, and what each task's completion triggers.

A completion bumps a sync counter on the device that owns it; the increment that reaches a
threshold calls the next emitter. Devices hand data over in one of two ways, both posted as a
Delivery that lands scheduler.latency(remote) later (nothing crosses devices instantly):
  P2P    (same node)   the producer stores into, or leaves data for, the other device and sets a
                       flag; the consumer's decoder runs when the flag lands and reads the
                       producer's buffer directly
  remote (other node)  the producer puts the data into a heap cell of the consumer with a signal;
                       the data lands with the signal, and the consumer's subscriber decodes it
Dispatch is such a delivery too: the token device sends each row tile's x rows (forward) or g
rows (backward) into the expert device's packet cell, and the initial decoder fires on arrival.
Backward thresholds (device of the row tile's expert, syncIdx s):
  tQS[gtQCl + s]  gradCombine x TNx + gradGateCombine x 1   = TNx + 1  -> notifyGradient
  tQS[s]          gradPostGEMM x TN                         = TN       -> notifyGradPreGEMM
                  + gradPreGEMM x TNx                       = TN + TNx -> flag / put + signal
Per-token gate dependency (token device h, local token t, token tile g):
  gateToken[t]    one per kept pair of t whose dot has landed   = kept(t)
  gateTile[g]     one per token of g whose gateToken is full    = |g|  -> notifyGateGradient
  tokens with no kept pair start full, so their aux/z-loss gradient is never waited for.
Forward: tQS[s] counts preGEMM (TN -> notifyNext) then postGEMM (TN + TNx -> flag / signal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shardmoe.tasks.emitters import Emitters
from shardmoe.tasks.memory import Memory
from shardmoe.tasks.plan import Plan, Ref, RowTile, Task, TaskType
from shardmoe.tasks.queues import SyncCounters


@dataclass(eq=False)
class Delivery:
    """Data plus its flag or signal on the way to `device`; land() writes the data (if it is
    copied) and runs the receiving decoder or subscriber. kind: "flag", "heap signal" or
    "gate signal"; tile: the row tile it concerns (for the trace)."""

    device: int
    kind: str
    tile: RowTile
    remote: bool
    land: Callable[[], None]


class Protocol:
    """Shared by both passes: counters per device, deliveries between devices, the finished check."""

    def __init__(self, plan: Plan, memory: Memory, emitters: Emitters):
        self.plan, self.memory, self.emit = plan, memory, emitters
        self.counters = [SyncCounters(d) for d in range(plan.peers)]
        self.outbox: list[Delivery] = []  # posted since the runtime last collected them

    def _used_slots(self, device: int) -> list[int]:
        return [t.sync_idx for t in self.plan.row_tiles if t.device == device]

    def _send(self, source: int, device: int, tile: RowTile, land: Callable[[], None], kind: str | None = None) -> None:
        remote = self.plan.is_remote(source, device)
        self.outbox.append(Delivery(device, kind or ("heap signal" if remote else "flag"), tile, remote, land))

    def _dispatch(self, tile: RowTile, rows: torch.Tensor, packet: str, decoder) -> None:
        """The token device sends the tile's rows (read now, at send time) into the expert device's
        packet cell (a P2P store or a heap put, same bytes); the initial decoder fires on arrival."""
        d, s = tile.device, tile.sync_idx

        def land():
            self.memory[Ref(d, packet, s)] = rows
            decoder(tile)
        self._send(tile.peer, d, tile, land)

    def _hand_back(self, tile: RowTile, source: Ref, p2p_decoder, remote_decoder) -> None:
        """The expert's rows are done: flag a P2P token device (its decoder reads `source` in place),
        or put a copy (taken now) into a remote one's heap cell with a signal."""
        d, h = tile.device, tile.peer
        if self.plan.is_remote(d, h):
            rows = self.memory[source].clone()

            def land():
                self.memory[Ref(h, "heap", (d, tile.sync_idx))] = rows
                remote_decoder(tile, h)
            self._send(d, h, tile, land)
        else:
            self._send(d, h, tile, lambda: p2p_decoder(tile))


class ForwardProtocol(Protocol):
    def start(self, x: torch.Tensor) -> None:
        plan, mem = self.plan, self.memory
        P, H = plan.config.ffn_size, plan.config.hidden_size
        z1_width = plan.config.kind.up_width(P)
        for d in range(plan.peers):
            lo, hi = plan.token_range[d]
            mem[Ref(d, "x")] = x[lo:hi]
            mem.zeros(Ref(d, "out"), (hi - lo, H), x.dtype)
            self.counters[d].define("tQS", torch.full((plan.gtqcl,), plan.tn + plan.tnx),
                                    label=lambda i: f"tQS[{i}] (preGEMM + postGEMM of syncIdx {i})")
        for tile in plan.row_tiles:
            d, s, m, h = tile.device, tile.sync_idx, tile.size, tile.peer
            for name, width in (("z1", z1_width), ("xm", P), ("z2", H), ("y_rows", H)):
                mem.zeros(Ref(d, name, s), (m, width), x.dtype)
            rows = mem[Ref(h, "x")][plan.local_tokens(tile.tokens, h)]
            self._dispatch(tile, rows, "x_rows", self.emit.forward_initial_decoder)

    def complete(self, task: Task) -> None:
        if task.type == TaskType.combine:
            return
        tile = self.plan.row_tile_of(task)
        count = self.counters[tile.device].add("tQS", tile.sync_idx, task)
        if task.type == TaskType.preGEMM and count == self.plan.tn:
            self.emit.notify_next(tile)
        elif task.type == TaskType.postGEMM and count == self.plan.tn + self.plan.tnx:
            self._hand_back(tile, Ref(tile.device, "y_rows", tile.sync_idx), self.emit.forward_final_decoder,
                            lambda t, own: self.emit.forward_final_decoder(t))

    def unfinished(self) -> list[str]:
        return [c for d in range(self.plan.peers) for c in self.counters[d].unfinished("tQS", self._used_slots(d))]


class BackwardProtocol(Protocol):
    def __init__(self, plan: Plan, memory: Memory, emitters: Emitters, gate_dependency: str = "token"):
        super().__init__(plan, memory, emitters)
        self.gate_dependency = gate_dependency
        self.gate_tokens = self._gate_ownership() if gate_dependency == "row_tile" else None

    def _gate_ownership(self) -> dict[tuple[int, int], torch.Tensor]:
        """Row-tile mode: row tile -> the tokens whose gate gradient it computes (those whose first kept
        pair it holds), so each token is counted once; tokens with no kept pair are owned by none."""
        first: dict[int, tuple[int, RowTile]] = {}
        for tile in self.plan.row_tiles:
            for token, pair in zip(tile.tokens.tolist(), tile.pairs.tolist()):
                if token not in first or pair < first[token][0]:
                    first[token] = (pair, tile)
        owned: dict[tuple[int, int], list[int]] = {(t.device, t.sync_idx): [] for t in self.plan.row_tiles}
        for token, (_, tile) in sorted(first.items()):
            owned[(tile.device, tile.sync_idx)].append(token)
        return {key: torch.tensor(tokens, dtype=torch.int64) for key, tokens in owned.items()}

    def start(self, x: torch.Tensor, grad_out: torch.Tensor, forward_memory: Memory, expert_grads: dict) -> None:
        plan, mem = self.plan, self.memory
        P, H, k = plan.config.ffn_size, plan.config.hidden_size, plan.config.top_k
        g, tn, tnx = plan.gtqcl, plan.tn, plan.tnx
        for d in range(plan.peers):
            lo, hi = plan.token_range[d]
            mem[Ref(d, "x")] = x[lo:hi]
            mem[Ref(d, "grad_out")] = grad_out[lo:hi]
            mem.zeros(Ref(d, "grad_x"), (hi - lo, H), x.dtype)
            mem.zeros(Ref(d, "gate_dots"), (hi - lo, k), plan.routing.weight.dtype)
            mem.zeros(Ref(d, "gate_weight_grad"), (H, plan.config.num_experts), x.dtype)
            if plan.config.router_bias:
                mem.zeros(Ref(d, "gate_bias_grad"), (plan.config.num_experts,), x.dtype)
            for name, shape in expert_grads.items():
                mem.zeros(Ref(d, "expert_grad", name), (plan.local_experts, *shape), x.dtype)
            self.counters[d].define("tQS", torch.tensor([tn + tnx] * g + [tnx + 1] * g), label=self._tqs_label)
            if self.gate_dependency == "token":
                self._define_gate_counters(d)
        for tile in plan.row_tiles:
            d, s, m, h = tile.device, tile.sync_idx, tile.size, tile.peer
            for name in ("x_rows", "z1", "xm", "z2"):
                mem[Ref(d, name, s)] = forward_memory[Ref(d, name, s)]
            for name, width in (("grad_expert", H), ("grad_xm", P), ("grad_x_rows", H)):
                mem.zeros(Ref(d, name, s), (m, width), x.dtype)
            rows = mem[Ref(h, "grad_out")][plan.local_tokens(tile.tokens, h)]
            self._dispatch(tile, rows, "grad_packet", self.emit.backward_initial_decoder)
        if self.gate_dependency == "token":
            for tile in plan.token_tiles:
                if self.counters[tile.device].values["gateTile"][tile.index] == tile.tokens.numel():
                    self.emit.notify_gate_gradient_tokens(tile)

    def _tqs_label(self, i: int) -> str:
        g = self.plan.gtqcl
        if i < g:
            return f"tQS[{i}] (gradPostGEMM + gradPreGEMM of syncIdx {i})"
        return f"tQS[gtQCl+{i - g}] (gradCombine + gradGateCombine of syncIdx {i - g})"

    def _define_gate_counters(self, device: int) -> None:
        lo, hi = self.plan.token_range[device]
        kept = self.plan.kept_pairs[lo:hi]
        tiles = [t for t in self.plan.token_tiles if t.device == device]
        sizes = torch.tensor([t.tokens.numel() for t in tiles], dtype=torch.int64)
        ready = torch.tensor([int((kept[self.plan.local_tokens(t.tokens, device)] == 0).sum()) for t in tiles],
                             dtype=torch.int64)
        self.counters[device].define("gateToken", kept, label=lambda i: f"gateToken[{i}] (token {lo + i})")
        self.counters[device].define("gateTile", sizes, initial=ready)

    def _gate_arrived(self, tile: RowTile, task: Task) -> None:
        """The dots of `tile` are in its token device's gate_dots: count one pair per token."""
        h, counters = tile.peer, self.counters[tile.peer]
        for token in tile.tokens.tolist():
            local = token - self.plan.token_range[h][0]
            if counters.add("gateToken", local, task) == int(counters.thresholds["gateToken"][local]):
                g = local // self.plan.block_m
                if counters.add("gateTile", g, task) == int(counters.thresholds["gateTile"][g]):
                    self.emit.notify_gate_gradient_tokens(self.plan.token_tile_at[(h, g)])

    def complete(self, task: Task) -> None:
        kind = task.type
        if kind in (TaskType.gradInputCombine, TaskType.gradGateGEMM):
            return
        tile, plan = self.plan.row_tile_of(task), self.plan
        counters, s, g = self.counters[tile.device], tile.sync_idx, plan.gtqcl
        if kind in (TaskType.gradCombine, TaskType.gradGateCombine):
            if counters.add("tQS", g + s, task) == plan.tnx + 1:
                self.emit.notify_gradient(tile)
                if self.gate_dependency == "row_tile":
                    tokens = self.gate_tokens[(tile.device, s)]
                    self._send(tile.device, tile.peer, tile, lambda: self.emit.gate_decoder_row_tile(tile, tokens))
            if kind == TaskType.gradGateCombine:
                self._deliver_dots(tile, task)
        elif kind == TaskType.gradPostGEMM:
            if counters.add("tQS", s, task) == plan.tn:
                self.emit.notify_grad_pre_gemm(tile)
        elif kind == TaskType.gradPreGEMM:
            if counters.add("tQS", s, task) == plan.tn + plan.tnx:
                self._hand_back(tile, Ref(tile.device, "grad_x_rows", s), self.emit.p2p_final_decoder,
                                self.emit.remote_final_decoder)

    def _deliver_dots(self, tile: RowTile, task: Task) -> None:
        """P2P: the dots are in gate_dots already (stored at the task's end). Remote: they land in
        the heap cell with a signal later, and the token device's subscriber scatters them. Only
        the per-token mode counts them (the row-tile mode waits for nothing)."""
        out, counted = task.operands["out"], self.gate_dependency == "token"
        if out.name != "gate_rows":
            if counted:
                self._gate_arrived(tile, task)
            return
        h, k = tile.peer, self.plan.config.top_k
        dots, cell = self.memory[out].clone(), Ref(h, "gate_heap", (tile.device, tile.sync_idx))

        def land():
            self.memory[cell] = dots
            self.memory[Ref(h, "gate_dots")][self.plan.local_tokens(tile.tokens, h), tile.pairs % k] = self.memory[cell]
            if counted:
                self._gate_arrived(tile, task)
        self._send(tile.device, h, tile, land, "gate signal")

    def unfinished(self) -> list[str]:
        out = []
        for d in range(self.plan.peers):
            used = self._used_slots(d)
            out += self.counters[d].unfinished("tQS", used + [self.plan.gtqcl + s for s in used])
            if self.gate_dependency == "token":
                lo, hi = self.plan.token_range[d]
                out += self.counters[d].unfinished("gateToken", list(range(hi - lo)))
                out += self.counters[d].unfinished(
                    "gateTile", [t.index for t in self.plan.token_tiles if t.device == d])
        return out
