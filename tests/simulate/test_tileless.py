"""The tensorless simulation runs the tile runtime's own schedule: on the same routing, scheduler
and seed its task counts, task order and logical timeline (every task's device, processor, start
and end, and every delivery's landing) equal shardmoe.tasks.run_forward / run_backward's."""
import pytest
import torch

import shardmoe
from shardmoe.simulate import simulate_backward, simulate_forward
from shardmoe.tasks.api import run_backward, run_forward
from shardmoe.tasks.schedulers import make_scheduler

CONFIGS = [  # (layer options, schedule options)
    (dict(top_k=2), dict(peers=4, ranks_per_node=2, processors=3)),
    (dict(top_k=3, capacity_factor=1.0), dict(peers=2, ranks_per_node=1, processors=2)),
    (dict(top_k=1, expert="mlp", bias=True), dict(peers=4, ranks_per_node=4, processors=1)),
]


def _runs(layer_options, schedule, scheduler, seed, gate_dependency):
    torch.manual_seed(seed)
    layer = shardmoe.MoE(16, 24, 8, dtype=torch.float64, **layer_options)
    x = torch.randn(40, 16, dtype=torch.float64)
    grad_out = torch.randn(40, 16, dtype=torch.float64)
    options = dict(schedule, scheduler=scheduler, seed=seed, block_m=4, block_n=8)
    fwd = run_forward(layer, x, **options)
    bwd = run_backward(layer, x, grad_out, forward=fwd, gate_dependency=gate_dependency, **options)
    return fwd, bwd


@pytest.mark.parametrize("layer_options,schedule", CONFIGS)
@pytest.mark.parametrize("scheduler,seed,gate_dependency",
                         [("fifo", 0, "token"), ("lifo", 0, "row_tile"), ("random", 3, "token"),
                          ("random", 11, "row_tile")])
def test_simulation_equals_tile_runtime(layer_options, schedule, scheduler, seed, gate_dependency):
    fwd, bwd = _runs(layer_options, schedule, scheduler, seed, gate_dependency)
    processors = schedule["processors"]
    sim_fwd, fwd_counts = simulate_forward(fwd.plan, make_scheduler(scheduler, seed), processors)
    sim_bwd, bwd_counts = simulate_backward(fwd.plan, make_scheduler(scheduler, seed), processors, gate_dependency)
    assert fwd_counts == fwd.counts and bwd_counts == bwd.counts
    assert sum(bwd_counts.values()) > 0
    for real, simulated in ((fwd.trace, sim_fwd), (bwd.trace, sim_bwd)):
        assert simulated.events == real.events  # type, device, processor, start, end, tile, uid, emitter
        assert simulated.signals == real.signals
        assert simulated.makespan == real.makespan > 0
