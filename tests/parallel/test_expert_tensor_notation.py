"""The notation guards expert tensor parallelism: with the expert intermediate dim split over t
(2 ranks, tp=2), drop one of the psums over t and the partial sum it should have reduced raises
UnreducedError at its first use, naming its spec, its axis and the consuming op.

Each rank drops the same reduction (expert_tensor's reduce_* replaced by a function that returns
its Unreduced input), so both fail at the same point and none waits in a collective. Each case
builds its own mesh, so that no case inherits another's exchange state.
"""
import torch

import shardmoe
from shardmoe.mesh import Mesh
from shardmoe.parallel import expert_tensor as etp
from shardmoe.parallel.shardops import UnreducedError
from shardmoe.testing import run_distributed

# case -> (layer options, the reduce_* function dropped, what the error must say)
CASES = {
    "glu output": (dict(expert="glu"), "reduce_expert_output",
                   "no attribute 'contiguous': it is 'N H' unreduced over {t}"),
    "glu input gradient": (dict(expert="glu"), "reduce_input_grad",
                           "no attribute 'contiguous': it is 'N H' unreduced over {t}"),
    "glu gate dots": (dict(expert="glu"), "reduce_gate_dot",
                      "no attribute 'contiguous': it is 'N' unreduced over {t}"),
    "mlp output before b2": (dict(expert="mlp", bias=True), "reduce_expert_output",
                             "cannot add Tensor to 'N H' unreduced over {t}"),
}


def _step(options: dict) -> None:
    """Forward and backward of one MoE layer on a fresh tp=2 mesh; the same tokens on both t ranks."""
    mesh = Mesh(tp=2)
    torch.manual_seed(0)
    layer = shardmoe.MoE(8, 8, 4, 2, mesh=mesh, dtype=torch.float64, **options)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    (layer(x).sum() + layer.aux_loss).backward()


def _world() -> dict:
    results = {}
    for name, (options, dropped, _) in CASES.items():
        _step(options)  # runs as written
        reduction, calls = getattr(etp, dropped), []

        def without_reduction(partial, mesh):
            calls.append(partial)
            return partial

        setattr(etp, dropped, without_reduction)
        try:
            _step(options)
            results[name] = ("no error", len(calls))
        except UnreducedError as error:
            results[name] = (str(error), len(calls))
        finally:
            setattr(etp, dropped, reduction)
    return results


def test_a_dropped_psum_over_t_is_named_where_its_result_is_used():
    for rank, results in enumerate(run_distributed(_world, 2, timeout=120, collective_timeout=30)):
        for name, (message, calls) in results.items():
            expected = CASES[name][2]
            assert calls, f"rank {rank} {name}: the dropped reduction was never called"
            assert expected in message, f"rank {rank} {name}: expected {expected!r}, got {message!r}"
