"""A rank that stops taking part makes its peers fail with a clear error within a timeout.

Rank 1 runs one good step, then hangs: in its row exchange (P2P topology; its peer waits on a
shared-memory flag) or before its next forward (remote topology; its peer waits in the counts
collective). Rank 0 must raise an error that names what it waited for, long before the world's
own deadline; the harness then reports rank 0's error and kills rank 1.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

import shardmoe
from shardmoe.mesh import Mesh
from shardmoe.testing import RankFailed, run_distributed

HANG_S = 120.0


def _hang_on_rank_one(ranks_per_node: int) -> None:
    os.environ["SHARDMOE_P2P_TIMEOUT_S"] = "2"
    mesh = Mesh(ep=2, ranks_per_node=ranks_per_node)
    torch.manual_seed(0)
    layer = shardmoe.MoE(8, 4, 4, 2, mesh=mesh)
    x = torch.randn(6, 8)
    layer(x).sum().backward()
    if dist.get_rank() == 1:
        if ranks_per_node == 2:
            layer._parallel.exchange.exchange = lambda *args: time.sleep(HANG_S)
        else:
            time.sleep(HANG_S)
    layer(x).sum().backward()


@pytest.mark.parametrize(
    "ranks_per_node, collective_timeout, message",
    [
        (2, 60.0, r"PeerTimeoutError: shared-memory exchange \d+: rank 0 waited 2 s for rank 1 to send its rows"),
        (1, 3.0, r"ExchangeError: expert-parallel counts exchange over mesh axes \('d', 'e'\) failed on rank 0: a peer failed"),
    ],
)
def test_a_hanging_rank_makes_its_peer_fail_with_a_clear_error(ranks_per_node, collective_timeout, message):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=message) as info:
        run_distributed(_hang_on_rank_one, 2, args=(ranks_per_node,), timeout=90,
                        collective_timeout=collective_timeout)
    assert info.value.rank == 0
    assert time.monotonic() - start < 45
