"""A rank that stops taking part makes its peers fail with a clear error within a timeout.

Rank 1 runs one good step, then hangs: in its row exchange (P2P topology; its peer waits on a
shared-memory flag) or before its next forward (remote topology; its peer waits in the counts
collective). Rank 0 must raise an error that names what it waited for, long before the world's
own deadline; the harness then reports rank 0's error and kills rank 1.
"""
import os
import re
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
            layer.dispatcher.exchange.exchange = lambda *args: time.sleep(HANG_S)
        else:
            time.sleep(HANG_S)
    layer(x).sum().backward()


@pytest.mark.parametrize(
    "ranks_per_node, collective_timeout, message",
    [
        (2, 60.0, r"PeerTimeoutError: shared-memory exchange \d+: rank 0 waited 2 s for rank 1 to send its rows"),
        (1, 3.0, r"ExchangeError: the forward of MoE layer \d+ \(its handshake\) over the whole mesh failed on rank 0: "
                  r"a peer failed"),
    ],
)
def test_a_hanging_rank_makes_its_peer_fail_with_a_clear_error(ranks_per_node, collective_timeout, message):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=message) as info:
        run_distributed(_hang_on_rank_one, 2, args=(ranks_per_node,), timeout=90,
                        collective_timeout=collective_timeout)
    assert info.value.rank == 0
    assert time.monotonic() - start < 45


# -- a peer that raised or exited is noticed within a liveness period, not at the P2P timeout ------

DETECT_S = 10.0  # the bound the test holds; SHARDMOE_P2P_TIMEOUT_S stays at its 120 s default


def _peer_fails_in_the_exchange(how: str) -> dict | None:
    """P2P ep=2 (fresh mesh): one good step, then rank 1 fails where its row exchange would run;
    rank 0 times its step until the error (None on rank 1, which raised and carries on)."""
    mesh = Mesh(ep=2, ranks_per_node=2)
    torch.manual_seed(0)
    layer = shardmoe.MoE(8, 4, 4, 2, mesh=mesh)
    x = torch.randn(6, 8)
    layer(x).sum().backward()
    if dist.get_rank() == 1:
        def fail(*args):
            if how == "exit":
                os._exit(3)  # no Python runs: only the process being gone tells the peer
            raise RuntimeError("rank 1 fails before its exchange")
        layer.dispatcher.exchange.exchange = fail
        with pytest.raises(RuntimeError, match="rank 1 fails before its exchange"):
            layer(x)
        return None
    start = time.monotonic()
    with pytest.raises(shardmoe.parallel.symmetric_heap.PeerExitedError) as info:
        layer(x).sum().backward()
    return dict(seconds=time.monotonic() - start, message=str(info.value))


def _raise_then_exit_on_rank_one() -> dict | None:
    assert "SHARDMOE_P2P_TIMEOUT_S" not in os.environ
    raised = _peer_fails_in_the_exchange("raise")
    return dict(raised=raised, exited=_peer_fails_in_the_exchange("exit"))


def test_a_peer_that_raised_or_exited_is_noticed_within_seconds():
    with pytest.raises(RankFailed) as info:
        run_distributed(_raise_then_exit_on_rank_one, 2, timeout=60, report_grace=30)
    assert info.value.rank == 1 and "exited with code 3" in info.value.details
    seen = info.value.results[0]
    for how, reason in (("raised", "raised an exception in its MoE layer"),
                        ("exited", r"exited \(its process \d+ is gone\)")):
        assert seen[how]["seconds"] < DETECT_S, seen[how]
        assert re.search(rf"shared-memory exchange \d+: rank 0 waited [\d.]+ s for rank 1 to send its rows, but rank 1 "
                         f"{reason}", seen[how]["message"]), seen[how]["message"]


# -- a peer that dies inside sync_grads -------------------------------------------------------------

def _exit_before_the_second_sync_on_rank_one() -> None:
    """Remote topology, ep=2: one good step and sync (its replica check included), then rank 1 exits
    where its next sync_grads would run."""
    from shardmoe.parallel import sync_grads

    mesh = Mesh(ep=2, ranks_per_node=1)
    torch.manual_seed(0)
    layer = shardmoe.MoE(8, 4, 4, 2, mesh=mesh)
    for step in range(2):
        layer(torch.randn(6, 8)).sum().backward()
        if step == 1 and dist.get_rank() == 1:
            os._exit(3)
        sync_grads(layer, mesh)


def test_a_peer_that_dies_inside_sync_grads_gives_an_exchange_error():
    """It surfaced as gloo's own RuntimeError ('Connection closed by peer'), unlike every exchange."""
    with pytest.raises(RankFailed) as info:
        run_distributed(_exit_before_the_second_sync_on_rank_one, 2, timeout=60, collective_timeout=10,
                        report_grace=30)
    assert re.search(r"ExchangeError: sync_grads of a module holding MoE layer \d+ \(its handshake\) over the whole "
                     r"mesh failed on rank 0: a peer failed, hung or left", str(info.value)), str(info.value)
