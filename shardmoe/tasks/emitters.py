"""Who creates tasks: the decoders (subscribers reading packets and signals) and the notifiers
(processors that push the next stage after a sync counter reaches its threshold).

Forward
  initial decoder   (expert device, packet of x rows arrived)  TN preGEMM           -> tQ
  notifyNext        (preGEMM counter reached TN)                TNx postGEMM         -> ptQ @0
  final decoder     (token device, flag or heap signal)         TNx combine          -> tQ
Backward
  initial decoder   (expert device, packet of g rows arrived)   TNx gradCombine
                                                                + 1 gradGateCombine  -> tQ
  notifyGradient    (combine counter reached TNx+1)             TN gradPostGEMM      -> ptQ @0
  notifyGateGradient                                            TNx gradGateGEMM     -> ptQ @TN
      per-token mode: token tile g of the token device, when every kept pair of each of
      its tokens has delivered its dot (gate domain tQH[2*gtQCl+g]);
      row-tile mode: see gate decoder below
  notifyGradPreGEMM (gradPostGEMM counter reached TN)           TNx gradPreGEMM      -> ptQ @TN+TNx
  P2P final decoder (token device, flag set by the expert)     TNx gradInputCombine -> tQ
                    reading the expert's dL/dx rows directly (isPeerRemote = false)
  remote final decoder (token device, heap signal)             TNx gradInputCombine -> tQ
                    only if isRemoteExpert = (peer != own rank); reads the heap cell
  gate decoder      (token device, flag or heap signal sent     TNx gradGateGEMM     -> tQ
                    when row tile s's combine counter reached TNx+1; row-tile mode)
gradGateCombine comes from the initial decoder only: a second one per row tile (the final
decoder also emitting it) completes its counters twice, which the counters reject.
"""
from __future__ import annotations

from shardmoe.tasks.plan import Plan, Ref, RowTile, Task, TaskType, TokenTile
from shardmoe.tasks.queues import DeviceQueues


class Emitters:
    """Task factories bound to a plan and the devices' queues."""

    def __init__(self, plan: Plan, queues: list[DeviceQueues], gate_dependency: str = "token",
                 final_gate_combine: bool = False):
        self.plan, self.queues = plan, queues
        self.gate_dependency, self.final_gate_combine = gate_dependency, final_gate_combine

    def _task(self, kind: TaskType, tile: RowTile, device: int, n: int, emitter: str, **operands) -> Task:
        return Task(kind, device, tile.sync_idx, n, tile.expert, tile.peer, operands,
                    self.plan.is_remote(tile.device, tile.peer), emitter)

    def _write_tq(self, kind: TaskType, tile: RowTile, device: int, columns: int, emitter: str, **operands) -> None:
        """Column tiles 0 .. columns-1 of `tile` into device's tQ."""
        for n in range(columns):
            self.queues[device].write_tq(self._task(kind, tile, device, n, emitter, **operands))

    def _write_ptq(self, kind: TaskType, tile: RowTile, columns: int, emitter: str, domain: str, **operands) -> None:
        """Column tiles 0 .. columns-1 of `tile` into its expert device's ptQ slot, in `domain`."""
        d = tile.device
        for n in range(columns):
            self.queues[d].write_ptq(self._task(kind, tile, d, n, emitter, **operands), tile.sync_idx, domain)

    # --- forward -------------------------------------------------------------------------------
    def forward_initial_decoder(self, tile: RowTile) -> None:
        d, s = tile.device, tile.sync_idx
        self._write_tq(TaskType.preGEMM, tile, d, self.plan.tn, "initial decoder",
                       x=Ref(d, "x_rows", s), z=Ref(d, "z1", s), a=Ref(d, "xm", s))

    def notify_next(self, tile: RowTile) -> None:
        d, s = tile.device, tile.sync_idx
        self._write_ptq(TaskType.postGEMM, tile, self.plan.tnx, "notifyNext", "primary",
                        a=Ref(d, "xm", s), z2=Ref(d, "z2", s), y=Ref(d, "y_rows", s))

    def forward_final_decoder(self, tile: RowTile) -> None:
        d, h, s = tile.device, tile.peer, tile.sync_idx
        source = Ref(h, "heap", (d, s)) if self.plan.is_remote(d, h) else Ref(d, "y_rows", s)
        self._write_tq(TaskType.combine, tile, h, self.plan.tnx, "final decoder", y=source, out=Ref(h, "out"))

    # --- backward ------------------------------------------------------------------------------
    def _gate_combine(self, tile: RowTile, device: int, emitter: str) -> Task:
        d, h, s = tile.device, tile.peer, tile.sync_idx
        # A P2P expert stores the dots straight into the token device's gate_dots; a remote one
        # writes its own gate_rows cell, which the protocol puts into the token device's heap.
        out = Ref(d, "gate_rows", s) if self.plan.is_remote(d, h) else Ref(h, "gate_dots")
        return self._task(TaskType.gradGateCombine, tile, device, 0, emitter,
                          g=Ref(d, "grad_packet", s), z2=Ref(d, "z2", s), out=out)

    def backward_initial_decoder(self, tile: RowTile) -> None:
        d, s = tile.device, tile.sync_idx
        self._write_tq(TaskType.gradCombine, tile, d, self.plan.tnx, "initial decoder",
                       g=Ref(d, "grad_packet", s), out=Ref(d, "grad_expert", s))
        self.queues[d].write_tq(self._gate_combine(tile, d, "initial decoder"))

    def notify_gradient(self, tile: RowTile) -> None:
        d, s = tile.device, tile.sync_idx
        self._write_ptq(TaskType.gradPostGEMM, tile, self.plan.tn, "notifyGradient", "primary",
                        ge=Ref(d, "grad_expert", s), z2=Ref(d, "z2", s), a=Ref(d, "xm", s),
                        out=Ref(d, "grad_xm", s), dw=Ref(d, "expert_grad"))

    def gate_decoder_row_tile(self, tile: RowTile, tokens) -> None:
        """FlashMoE's rule (row-tile mode): gradGateGEMM of a row tile over the tokens it owns
        (their first kept pair), released by the row tile's combine counter. The expert device
        flags (or signals) the token device, whose decoder writes the tasks into its own tQ: x, the
        gate dots and grad_x live there, and a remote device may not be read."""
        h = tile.peer
        self._write_tq(TaskType.gradGateGEMM, tile, h, self.plan.tnx, "gate decoder", tokens=tokens,
                       x=Ref(h, "x"), dots=Ref(h, "gate_dots"), out=Ref(h, "grad_x"), dwg=Ref(h, "gate_weight_grad"),
                       dwb=Ref(h, "gate_bias_grad"))

    def notify_gate_gradient_tokens(self, tile: TokenTile) -> None:
        """gradGateGEMM of a token tile whose tokens have all their dots, on the token device."""
        h, g = tile.device, tile.index
        for n in range(self.plan.tnx):
            task = Task(TaskType.gradGateGEMM, h, g, n, -1, h,
                        dict(tokens=tile.tokens, x=Ref(h, "x"), dots=Ref(h, "gate_dots"), out=Ref(h, "grad_x"),
                             dwg=Ref(h, "gate_weight_grad"), dwb=Ref(h, "gate_bias_grad")), False, "notifyGateGradient")
            self.queues[h].write_ptq(task, g, "gate")

    def notify_grad_pre_gemm(self, tile: RowTile) -> None:
        d, s = tile.device, tile.sync_idx
        self._write_ptq(TaskType.gradPreGEMM, tile, self.plan.tnx, "notifyGradPreGEMM", "secondary",
                        grad=Ref(d, "grad_xm", s), z=Ref(d, "z1", s), x=Ref(d, "x_rows", s),
                        out=Ref(d, "grad_x_rows", s), dw=Ref(d, "expert_grad"))

    def p2p_final_decoder(self, tile: RowTile) -> None:
        d, h, s = tile.device, tile.peer, tile.sync_idx
        self._write_tq(TaskType.gradInputCombine, tile, h, self.plan.tnx, "P2P final decoder",
                       src=Ref(d, "grad_x_rows", s), out=Ref(h, "grad_x"))
        if self.final_gate_combine:
            self.queues[h].write_tq(self._gate_combine(tile, h, "P2P final decoder"))

    def remote_final_decoder(self, tile: RowTile, own_rank: int) -> None:
        d, h, s = tile.device, tile.peer, tile.sync_idx
        is_remote_expert = d != own_rank  # FlashMoE's guard; a rank is never remote to itself
        if is_remote_expert:
            self._write_tq(TaskType.gradInputCombine, tile, h, self.plan.tnx, "remote final decoder",
                           src=Ref(h, "heap", (d, s)), out=Ref(h, "grad_x"))
        if self.final_gate_combine:
            self.queues[h].write_tq(self._gate_combine(tile, h, "remote final decoder"))
