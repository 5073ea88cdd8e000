"""The gate-gradient dependency: gradGateGEMM of a token needs the dots of ALL its kept pairs.

FlashMoE's rule ("row_tile": a row tile's gradGateGEMM is released when that row tile's own
gradCombine + gradGateCombine counter reaches TNx+1) lets it read a token's gate_dots before the
token's other experts have written theirs. The project's rule ("token": per-token counters feeding
a token-tile counter) is exact under every order. And gradGateCombine emitted by the final decoder
as well as the initial one completes its counter twice, which raises."""
import pytest
import torch

import shardmoe
from shardmoe.tasks import ScheduleError, run_backward, run_forward

SCHEDULE = dict(peers=2, block_m=2, block_n=4)


def _setup(top_k, renormalize=True):
    torch.manual_seed(11)
    layer = shardmoe.MoE(8, 6, 4, top_k, expert="mlp", activation="silu", renormalize=renormalize,
                         dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(12, 8, dtype=torch.float64)
    out = layer(x)
    params = dict(layer.named_parameters())
    want = dict(zip(["x", *params], torch.autograd.grad((out * grad_out).sum(), [x, *params.values()])))
    return layer, x, grad_out, want


def _relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _late_dots(bwd) -> bool:
    """Did some row tile's gradGateGEMM start (it reads the dots when it starts) before a
    gradGateCombine of one of its owned tokens had ended? Owner = the row tile of the token's first
    kept pair. (In FlashMoE every dot is a store into FlashMoE's global [S, E] buffer at the task's end.)"""
    plan = bwd.forward.plan
    tile_of = {(t.expert, t.sync_idx): t for t in plan.row_tiles}
    first = {}
    for t in plan.row_tiles:
        for token, pair in zip(t.tokens.tolist(), t.pairs.tolist()):
            first[token] = min(first.get(token, (pair, t)), (pair, t), key=lambda v: v[0])
    dots_done = {}
    for e in bwd.trace.events:
        if e.type == "gradGateCombine":
            for token in tile_of[(e.expert, e.sync_idx)].tokens.tolist():
                dots_done[token] = max(dots_done.get(token, 0.0), e.end)
    for e in bwd.trace.events:
        if e.type == "gradGateGEMM":
            tile = tile_of[(e.expert, e.sync_idx)]
            owned = [t for t in tile.tokens.tolist() if first[t][1] is tile]
            if any(dots_done[t] > e.start for t in owned):
                return True
    return False


def test_row_tile_threshold_races_and_the_per_token_dependency_does_not():
    layer, x, grad_out, want = _setup(top_k=2)
    fwd = run_forward(layer, x, **SCHEDULE)
    racy_seeds = []
    for seed in range(40):
        row_tile_mode = run_backward(layer, x, grad_out, seed=seed, grad_loss=0.0, gate_dependency="row_tile",
                                 forward=fwd, **SCHEDULE)
        wrong = _relative(row_tile_mode.grads["gate_weight"], want["gate_weight"]) > 1e-6
        # the mechanism: wrong exactly when a gradGateGEMM read a token's dots before all had landed
        assert wrong == _late_dots(row_tile_mode), seed
        # the race touches only the gate path: the expert gradients stay exact
        for name in ("w1", "w2"):
            assert _relative(row_tile_mode.grads[name], want[name]) <= 1e-12
        if wrong:
            racy_seeds.append(seed)
            assert _relative(row_tile_mode.grad_input, want["x"]) > 1e-9
        fixed = run_backward(layer, x, grad_out, seed=seed, grad_loss=0.0, forward=fwd, **SCHEDULE)
        for name, w in want.items():
            got = fixed.grad_input if name == "x" else fixed.grads[name]
            assert _relative(got, w) <= 1e-12, (seed, name)
    assert racy_seeds, "no random schedule exposed the row-tile race"
    assert len(racy_seeds) < 40, "the row-tile rule should also be right in some orders (it is a race)"


def test_row_tile_threshold_is_enough_for_top_1():
    """With one pair per token the row tile's own gradGateCombine is all a token needs (without
    renormalisation, so that the top-1 gate gradient is not identically zero)."""
    layer, x, grad_out, want = _setup(top_k=1, renormalize=False)
    fwd = run_forward(layer, x, **SCHEDULE)
    for seed in range(10):
        bwd = run_backward(layer, x, grad_out, seed=seed, grad_loss=0.0, gate_dependency="row_tile", forward=fwd,
                           **SCHEDULE)
        assert _relative(bwd.grads["gate_weight"], want["gate_weight"]) <= 1e-12


@pytest.mark.parametrize("ranks_per_node", [None, 1])
@pytest.mark.parametrize("gate_dependency", ["token", "row_tile"])
def test_gate_combine_from_the_final_decoder_is_caught(ranks_per_node, gate_dependency):
    layer, x, grad_out, _ = _setup(top_k=2)
    schedule = dict(SCHEDULE, ranks_per_node=ranks_per_node)
    fwd = run_forward(layer, x, **schedule)
    decoder = "P2P" if ranks_per_node is None else "(P2P|remote)"
    # over the network the remote final decoder's gradGateCombine would also load the expert's
    # rows from another node, which is refused when it starts (if that comes first)
    remote_load = "" if ranks_per_node is None else (r"|task gradGateCombine\(.*from remote final decoder\) names "
                                                     r"g=grad_packet of device \d on another node")
    for seed in range(3):
        with pytest.raises(ScheduleError, match=rf"counter tQS\[gtQCl\+\d+\] \(gradCombine \+ gradGateCombine .*"
                                                rf"passes its threshold 3 \(reaches 4\) at gradGateCombine\(.*"  # TNx + 1 = 3
                                                rf"from {decoder} final decoder\){remote_load}"):
            run_backward(layer, x, grad_out, seed=seed, forward=fwd, gate_dependency=gate_dependency,
                         final_gate_combine=True, **schedule)
