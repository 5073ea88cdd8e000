"""The scheduler learns of work only by reading tQ and ptQ, and data crosses devices only by
deliveries that take time: the queue hazards of FlashMoE's backward design (docs/tasks.md) surface
as a ScheduleError naming the slot, and initial decoders fire when their packet lands."""
import pytest
import torch

import shardmoe
from shardmoe.moe.routing import route
from shardmoe.tasks import ScheduleError, api, run_backward, run_forward
from shardmoe.tasks.emitters import Emitters
from shardmoe.tasks.plan import Plan, Ref, Task, TaskType
from shardmoe.tasks.queues import DeviceQueues, Domain, PtqLayout, QueueReader
from shardmoe.tasks.runtime import build_queues

SCHEDULE = dict(peers=4, ranks_per_node=2, block_m=2, block_n=4)


def _layer_and_inputs():
    torch.manual_seed(4)
    layer = shardmoe.MoE(8, 6, 4, 2, expert="mlp", dtype=torch.float64)
    x = torch.randn(12, 8, dtype=torch.float64)
    return layer, x, torch.randn(12, 8, dtype=torch.float64)


def test_reader_decodes_heads_with_its_own_stride_and_checks_each_entry():
    layer, x, _ = _layer_and_inputs()
    plan = Plan(layer.config, route(x, layer.gate_weight.detach(), layer.config), 12, block_m=2, block_n=4)
    layout = PtqLayout(plan, backward=True)
    tn, tnx, g, stride = plan.tn, plan.tnx, plan.gtqcl, layout.stride
    dq = DeviceQueues(0, 3, layout, g)
    reader = QueueReader(dq, PtqLayout(plan, backward=True))
    dq.write_tq(Task(TaskType.gradCombine, 0, 1, 0, 0, 0))
    dq.write_ptq(Task(TaskType.gradPreGEMM, 0, 2, 0, 0, 0), 2, "secondary")
    dq.write_ptq(Task(TaskType.gradGateGEMM, 0, 1, 0, -1, 0), 1, "gate")
    # tQ entry 0, then tQH[gtQCl+2] (secondary, offset TN+TNx), then tQH[2*gtQCl+1] (gate, offset TN)
    signals = reader.poll()
    assert signals == [0, 3 + 2 * stride + tn + tnx, 3 + 1 * stride + tn]
    assert [reader.read(s).type for s in signals] == [TaskType.gradCombine, TaskType.gradPreGEMM,
                                                      TaskType.gradGateGEMM]
    assert reader.poll() == []
    with pytest.raises(ScheduleError, match=rf"ptQ slot 2 \(entry {tn + tnx}, signal {signals[1]}\) of device 0 "
                                            r"was already consumed"):
        reader.read(signals[1])
    with pytest.raises(ScheduleError, match=rf"ptQ slot 3 \(entry 0, signal {3 + 3 * stride}\) of device 0 is empty"):
        reader.read(3 + 3 * stride)
    dq.write_ptq(Task(TaskType.gradPostGEMM, 0, 5, 0, 0, 0), 4, "primary")  # written under a foreign syncIdx
    with pytest.raises(ScheduleError, match=r"ptQ slot 4 \(entry 0, .* holds gradPostGEMM\(device=0, syncIdx=5.* "
                                            r"does not belong there \(expected gradPostGEMM of device 0, syncIdx 4\)"):
        reader.read(reader.poll()[0])
    for _ in range(tn + 1):  # one more than the primary domain holds in the per-token mode
        dq.write_ptq(Task(TaskType.gradPostGEMM, 0, 6, 0, 0, 0), 6, "primary")
    with pytest.raises(ScheduleError, match=rf"ptQ of device 0, slot 6: tQH\[6\] \(primary domain\) announces "
                                            rf"{tn + 1} entries, the domain holds {tn}"):
        reader.poll()


def _plant(monkeypatch, change):
    """Run the writers with a layout changed by `change`; the scheduler keeps the true one."""
    def build(plan, backward, ledger, gate_dependency="token"):
        queues = build_queues(plan, backward, ledger, gate_dependency)
        writer = PtqLayout(plan, backward, gate_dependency)
        change(plan, writer)
        for dq in queues:
            dq.layout = writer
        return queues
    monkeypatch.setattr(api, "build_queues", build)


@pytest.mark.parametrize("gate_dependency", ["token", "row_tile"])
def test_the_forward_stride_in_the_backward_is_caught_at_a_slot(monkeypatch, gate_dependency):
    """The scheduler must read ptQ at the stride notifyGradient writes (TN + 2*TNx in the backward:
    docs/tasks.md). A writer still on the forward's TN + TNx puts slot s's tasks where the reader's
    slot s is not."""
    layer, x, grad_out = _layer_and_inputs()
    fwd = run_forward(layer, x, **SCHEDULE)

    def forward_stride(plan, writer):
        writer.stride = plan.tn + plan.tnx
    _plant(monkeypatch, forward_stride)
    with pytest.raises(ScheduleError, match=r"ptQ slot \d+ \(entry \d+, signal \d+\) of device \d (is empty|holds "
                                            r".* which does not belong there|was already consumed)"):
        run_backward(layer, x, grad_out, forward=fwd, gate_dependency=gate_dependency, **SCHEDULE)


@pytest.mark.parametrize("gate_dependency", ["token", "row_tile"])
def test_grad_pre_gemm_in_the_primary_domain_is_caught_at_a_slot(monkeypatch, gate_dependency):
    """gradPreGEMM has its own head tQH[gtQCl + s], the secondary domain (docs/tasks.md). Written
    through the primary head tQH[s] instead, it lands behind gradPostGEMM (and gradGateGEMM), which
    the reader refuses."""
    layer, x, grad_out = _layer_and_inputs()
    fwd = run_forward(layer, x, **SCHEDULE)

    def primary(plan, writer):
        writer.domains["secondary"] = Domain("primary", 0, 0, writer.stride)
    _plant(monkeypatch, primary)
    with pytest.raises(ScheduleError, match=r"ptQ of device \d, slot \d+: tQH\[\d+\] \(primary domain\) announces "
                                            r"\d+ entries, the domain holds \d+|ptQ slot \d+ .* holds gradPreGEMM"):
        run_backward(layer, x, grad_out, forward=fwd, gate_dependency=gate_dependency, **SCHEDULE)


def test_packets_arrive_before_their_decoders_fire():
    """Dispatch travels like every other datum: each row tile's x rows (forward) and g rows
    (backward) land by a flag (same node) or a heap signal (other node) after a positive latency,
    and no task of that tile starts before its packet landed."""
    layer, x, grad_out = _layer_and_inputs()
    fwd = run_forward(layer, x, scheduler="random", seed=3, **SCHEDULE)
    bwd = run_backward(layer, x, grad_out, forward=fwd, scheduler="random", seed=3, **SCHEDULE)
    plan = fwd.plan
    for trace, first in ((fwd.trace, "preGEMM"), (bwd.trace, "gradCombine")):
        arrivals = {}  # (expert device, syncIdx) -> its arrivals in time order; the first is the packet
        for s in sorted(trace.signals, key=lambda s: s.time):
            arrivals.setdefault((s.source, s.sync_idx), []).append(s)
        for tile in plan.row_tiles:
            dispatch = next(s for s in arrivals[(tile.device, tile.sync_idx)] if s.device == tile.device)
            assert dispatch.kind == ("heap signal" if plan.is_remote(tile.device, tile.peer) else "flag")
            assert dispatch.time > 0
            starts = [e.start for e in trace.events if e.type == first and e.device == tile.device
                      and e.sync_idx == tile.sync_idx]
            assert starts and min(starts) >= dispatch.time
        times = {s.time for s in trace.signals if s.device == s.source}
        assert len(times) > 1  # decoders fire at different times, not all at once


def test_remote_data_reaches_a_task_only_through_its_own_heap(monkeypatch):
    """Every run checks that no task names a buffer of a device on another node. The row-tile gate
    mode (FlashMoE's release rule) obeys it: its gradGateGEMM runs on the tokens' device (released
    by a flag or heap signal from the row tile's expert) and a remote expert's dots come through a
    heap cell. Run on the expert device, where FlashMoE's notifyGateGradient places it, the task is
    refused when it starts."""
    layer, x, grad_out = _layer_and_inputs()
    schedule = dict(SCHEDULE, ranks_per_node=1)  # every pair of distinct devices is remote
    fwd = run_forward(layer, x, **schedule)
    bwd = run_backward(layer, x, grad_out, forward=fwd, gate_dependency="row_tile", **schedule)
    plan = fwd.plan
    assert any(plan.is_remote(t.device, t.peer) for t in plan.row_tiles)
    gate_tasks = [e for e in bwd.trace.events if e.type == "gradGateGEMM"]
    tile_of = {(t.expert, t.sync_idx): t for t in plan.row_tiles}
    assert gate_tasks and all(e.device == tile_of[(e.expert, e.sync_idx)].peer for e in gate_tasks)

    def on_the_expert(self, tile, tokens):
        d, h = tile.device, tile.peer
        self._write_tq(TaskType.gradGateGEMM, tile, d, self.plan.tnx, "gate decoder", tokens=tokens,
                       x=Ref(h, "x"), dots=Ref(h, "gate_dots"), out=Ref(h, "grad_x"), dwg=Ref(d, "gate_weight_grad"))
    monkeypatch.setattr(Emitters, "gate_decoder_row_tile", on_the_expert)
    with pytest.raises(ScheduleError, match=r"task gradGateGEMM\(device=(\d), .*from gate decoder\) names x=x of "
                                            r"device (?!\1)\d on another node \(remote data arrives only through a "
                                            r"heap cell\)"):
        run_backward(layer, x, grad_out, forward=fwd, gate_dependency="row_tile", **schedule)
