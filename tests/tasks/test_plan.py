"""Plan, queues and emitters: tiles, sync indices, strides, capacities, closed-form counts."""
import math

import pytest
import torch

import shardmoe
from shardmoe.moe.routing import route
from shardmoe.tasks import ScheduleError, run_backward, run_forward
from shardmoe.tasks.emitters import Emitters
from shardmoe.tasks.plan import Plan, Task, TaskType, backward_task_counts, forward_task_counts
from shardmoe.tasks.queues import DeviceQueues, PtqLayout, SyncCounters, tq_capacity
from shardmoe.tasks.runtime import Ledger, build_queues


def _hand_layer():
    """H=2, P=5, E=2, k=1, gate logits (x0, -x0): a token goes to expert 0 iff x0 > 0."""
    layer = shardmoe.MoE(2, 5, 2, 1, expert="mlp", activation="relu", dtype=torch.float64)
    with torch.no_grad():
        layer.gate_weight.copy_(torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    signs = torch.tensor([1, 1, -1, 1, 1, -1, 1, -1], dtype=torch.float64)
    x = torch.stack([signs, torch.linspace(-1, 1, 8, dtype=torch.float64)], 1)
    return layer, x


def _plan(layer, x, **kw):
    return Plan(layer.config, route(x, layer.gate_weight.detach(), layer.config), x.shape[0], **kw)


def test_hand_case_tiles_and_counts():
    layer, x = _hand_layer()
    # peer 0 holds tokens 0-3 (experts 0,0,1,0), peer 1 tokens 4-7 (experts 0,1,0,1); block_m 2:
    # (p0,e0) 3 rows -> 2 tiles, (p0,e1) 1 -> 1, (p1,e0) 2 -> 1, (p1,e1) 2 -> 1: R = 5 row tiles
    plan = _plan(layer, x, peers=2, ranks_per_node=1, block_m=2, block_n=2)
    assert (plan.tn, plan.tnx, plan.tcm, plan.local_experts) == (3, 1, 2, 1)
    assert len(plan.row_tiles) == 5 and len(plan.token_tiles) == 4
    assert sorted((t.device, t.sync_idx, t.size) for t in plan.row_tiles) == [
        (0, 0, 2), (0, 1, 1), (0, 2, 2), (1, 0, 1), (1, 2, 2)]  # syncIdx = (p * nLx + le) * TCM + tile
    assert forward_task_counts(plan) == {TaskType.preGEMM: 15, TaskType.postGEMM: 5, TaskType.combine: 5}
    assert backward_task_counts(plan) == {
        TaskType.gradCombine: 5, TaskType.gradGateCombine: 5, TaskType.gradPostGEMM: 15, TaskType.gradPreGEMM: 5,
        TaskType.gradInputCombine: 5, TaskType.gradGateGEMM: 4}
    assert backward_task_counts(plan, "row_tile")[TaskType.gradGateGEMM] == 5
    grad_out = torch.ones_like(x)
    fwd = run_forward(layer, x, peers=2, ranks_per_node=1, block_m=2, block_n=2)
    bwd = run_backward(layer, x, grad_out, peers=2, ranks_per_node=1, block_m=2, block_n=2, forward=fwd)
    assert fwd.counts == {"preGEMM": 15, "postGEMM": 5, "combine": 5}
    assert bwd.counts == {"gradCombine": 5, "gradGateCombine": 5, "gradPostGEMM": 15, "gradPreGEMM": 5,
                          "gradInputCombine": 5, "gradGateGEMM": 4}


def test_row_tiles_cover_every_kept_pair_once_with_capacity_drops():
    torch.manual_seed(3)
    layer = shardmoe.MoE(8, 6, 8, 3, expert="glu", capacity_factor=0.5, dtype=torch.float64)
    x = torch.randn(13, 8, dtype=torch.float64)
    plan = _plan(layer, x, peers=4, ranks_per_node=2, block_m=3, block_n=4)
    pairs = torch.cat([t.pairs for t in plan.row_tiles])
    assert sorted(pairs.tolist()) == sorted(plan.routing.row_pair.tolist())
    assert plan.routing.dropped_pairs > 0
    for t in plan.row_tiles:
        lo, hi = plan.token_range[t.peer]
        assert 1 <= t.size <= 3 and bool(((t.tokens >= lo) & (t.tokens < hi)).all())
        assert t.device == t.expert // plan.local_experts and t.sync_idx < plan.peers * plan.local_experts * plan.tcm
        assert torch.equal(t.weight, plan.routing.weight.reshape(-1)[t.pairs])
    # 13 tokens over 4 peers in contiguous blocks 4, 3, 3, 3; EC = ceil(13/8 * 0.5 * 3) = 3 bounds the rows
    assert plan.token_range == [(0, 4), (4, 7), (7, 10), (10, 13)]
    assert plan.tcm == math.ceil(min(4, 3) / 3)
    assert [plan.is_remote(0, d) for d in range(4)] == [False, False, True, True]


def test_ptq_strides_and_head_domains():
    layer, x = _hand_layer()
    plan = _plan(layer, x, block_m=2, block_n=2)
    tn, tnx, g = plan.tn, plan.tnx, plan.gtqcl
    assert PtqLayout(plan, backward=False).stride == tn + tnx
    seed_layout = PtqLayout(plan, backward=True, gate_dependency="row_tile")
    assert seed_layout.stride == tn + 2 * tnx
    assert {n: (d.head_base, d.offset, d.size) for n, d in seed_layout.domains.items()} == {
        "primary": (0, 0, tn), "secondary": (g, tn + tnx, tnx)}
    layout = PtqLayout(plan, backward=True)
    assert layout.stride == tn + 2 * tnx
    assert {n: (d.head_base, d.offset, d.size) for n, d in layout.domains.items()} == {
        "primary": (0, 0, tn), "secondary": (g, tn + tnx, tnx), "gate": (2 * g, tn, tnx)}


def test_notifiers_write_at_the_documented_offsets():
    layer, x = _hand_layer()
    plan = _plan(layer, x, block_m=2, block_n=2)
    ledger = Ledger()
    queues = build_queues(plan, True, ledger)
    emit = Emitters(plan, queues)
    tile = plan.row_tiles[1]
    emit.notify_gradient(tile)
    emit.notify_grad_pre_gemm(tile)
    emit.notify_gate_gradient_tokens(plan.token_tiles[1])
    stride, s, tn, tnx = queues[0].layout.stride, tile.sync_idx, plan.tn, plan.tnx
    ptq = queues[0].ptq
    assert [ptq[s * stride + i].type for i in range(tn)] == [TaskType.gradPostGEMM] * tn
    assert [ptq[s * stride + tn + tnx + i].type for i in range(tnx)] == [TaskType.gradPreGEMM] * tnx
    assert [ptq[1 * stride + tn + i].type for i in range(tnx)] == [TaskType.gradGateGEMM] * tnx
    assert queues[0].heads[s] == tn and queues[0].heads[plan.gtqcl + s] == tnx and queues[0].heads[2 * plan.gtqcl + 1] == tnx
    assert [t.uid for t in ledger.tasks] == list(range(tn + 2 * tnx))


def test_remote_final_decoder_applies_is_remote_expert():
    """isRemoteExpert = (peer != own rank): a signal a rank sends itself yields no gradInputCombine."""
    layer, x = _hand_layer()
    plan = _plan(layer, x, peers=2, ranks_per_node=1, block_m=2, block_n=2)
    queues = build_queues(plan, True, Ledger())
    emit = Emitters(plan, queues)
    remote = next(t for t in plan.row_tiles if t.device != t.peer)
    emit.remote_final_decoder(remote, own_rank=remote.peer)
    written = queues[remote.peer].tq[:queues[remote.peer].tq_tail]
    assert [t.type for t in written] == [TaskType.gradInputCombine] * plan.tnx
    assert all(t.remote and t.operands["src"].name == "heap" for t in written)
    queues = build_queues(plan, True, Ledger())
    local = next(t for t in plan.row_tiles if t.device == t.peer)
    Emitters(plan, queues).remote_final_decoder(local, own_rank=local.device)
    assert queues[local.peer].tq_tail == 0


def test_tq_capacity_bounds_every_run():
    torch.manual_seed(5)
    layer = shardmoe.MoE(8, 6, 4, 4, expert="mlp", dtype=torch.float64)
    x = torch.randn(16, 8, dtype=torch.float64)
    fwd = run_forward(layer, x, peers=2, block_m=2, block_n=3)
    plan = fwd.plan
    # top_k = E: every (peer, expert) group holds all of the peer's tokens, so each device's tQ
    # fills its bound exactly (expert side peers*nLx*TCM tiles, token side E*TCM tiles)
    assert plan.tcm * plan.block_m >= max(hi - lo for lo, hi in plan.token_range)
    assert tq_capacity(plan, True) == plan.peers * plan.local_experts * plan.tcm * (plan.tnx + 1) + \
        plan.config.num_experts * plan.tcm * plan.tnx
    bwd = run_backward(layer, x, torch.randn_like(x), peers=2, block_m=2, block_n=3, forward=fwd)
    used = sum(v for k, v in bwd.counts.items() if k in ("gradCombine", "gradGateCombine", "gradInputCombine"))
    assert used == plan.peers * tq_capacity(plan, True)


def test_overflows_and_counters_raise_naming_task_and_queue():
    layer, x = _hand_layer()
    plan = _plan(layer, x, block_m=2, block_n=2)
    task = Task(TaskType.gradCombine, 0, 3, 0, 1, 0)
    dq = DeviceQueues(0, 1, PtqLayout(plan, True), plan.gtqcl)
    dq.write_tq(task)
    with pytest.raises(ScheduleError, match=r"tQ of device 0 overflows its capacity 1 at task gradCombine\(device=0, "
                                            r"syncIdx=3"):
        dq.write_tq(Task(TaskType.gradCombine, 0, 3, 1, 1, 0))
    last = plan.gtqcl - 1  # a writer checks only its allocation: the last slot's secondary domain ends it
    for _ in range(plan.tnx):
        dq.write_ptq(Task(TaskType.gradPreGEMM, 0, last, 0, 1, 0), last, "secondary")
    with pytest.raises(ScheduleError, match=rf"ptQ of device 0: entry {plan.gtqcl * dq.layout.stride} of slot {last} "
                                            rf"\(secondary domain tQH\[{plan.gtqcl + last}\]\) lies past its "
                                            rf"{plan.gtqcl * dq.layout.stride} entries at task gradPreGEMM"):
        dq.write_ptq(Task(TaskType.gradPreGEMM, 0, last, 9, 1, 0), last, "secondary")
    counters = SyncCounters(1)
    counters.define("tQS", torch.tensor([2, 2]))
    assert counters.add("tQS", 1, task) == 1 and counters.add("tQS", 1, task) == 2
    with pytest.raises(ScheduleError, match=r"counter tQS\[1\] on device 1 passes its threshold 2 \(reaches 3\) "
                                            r"at gradCombine"):
        counters.add("tQS", 1, task)


def test_ledger_runs_each_task_exactly_once():
    ledger = Ledger()
    task = Task(TaskType.gradPostGEMM, 0, 1, 2, 0, 0)
    ledger.written(task)
    with pytest.raises(ScheduleError, match="written into a queue a second time"):
        ledger.written(task)
    ledger.started(task)
    ledger.finished(task)
    with pytest.raises(ScheduleError, match=r"gradPostGEMM\(device=0, syncIdx=1, tileIdx=2.* is done where queued"):
        ledger.started(task)


@pytest.mark.parametrize("kw, match", [
    (dict(peers=3), "peers: expected a divisor of num_experts=4"),
    (dict(block_m=0), "block_m: expected an int >= 1"),
    (dict(ranks_per_node=0), "ranks_per_node: expected an int >= 1"),
    (dict(scheduler="greedy"), "scheduler: expected one of fifo, lifo, random"),
    (dict(processors=0), "processors: expected an int >= 1"),
])
def test_bad_options_name_the_option(kw, match):
    layer = shardmoe.MoE(8, 6, 4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        run_forward(layer, torch.randn(5, 8, dtype=torch.float64), **kw)


def test_a_sharded_layer_is_refused():
    layer = shardmoe.MoE(8, 6, 4, 2, dtype=torch.float64)
    with torch.no_grad():
        layer.down_proj = torch.nn.Parameter(layer.down_proj[:, :, :3].clone())  # one rank's 't' shard
    with pytest.raises(ValueError, match=r"layer.down_proj: expected the whole parameter \[4, 8, 6\], got \[4, 8, 3\]"):
        run_forward(layer, torch.randn(5, 8, dtype=torch.float64))
