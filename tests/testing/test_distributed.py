"""The spawn harness: results come back in rank order, failures and hangs surface fast."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from shardmoe.testing import RankFailed, run_distributed


def _report_environment_and_exchange(scale):
    """Each rank reports its env and does an uneven all_to_all in which rank 0 holds no tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    # Rank r holds r tokens and sends them all to rank (r + 1) % world: rank 0 sends and holds none.
    tokens = torch.full((rank, 2), float(rank) * scale)
    send = [rank if peer == (rank + 1) % world else 0 for peer in range(world)]
    recv = [(rank - 1) % world if peer == (rank - 1) % world else 0 for peer in range(world)]
    received = torch.empty(sum(recv), 2)
    dist.all_to_all_single(received, tokens, recv, send)
    return env, received


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one has bad news")
    dist.barrier()  # rank 0 would wait here until the collective timeout


def _exit_silently_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _sleep():
    time.sleep(600)


def test_results_in_rank_order_with_zero_token_ranks():
    results = run_distributed(_report_environment_and_exchange, 4, args=(10.0,), ranks_per_node=2, timeout=60)
    for rank, (env, received) in enumerate(results):
        assert env == {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2"}
        sender = (rank - 1) % 4
        assert torch.equal(received, torch.full((sender, 2), sender * 10.0))
    assert results[1][1].shape == (0, 2)  # rank 0 sent rank 1 nothing


def test_a_failing_rank_raises_in_the_parent_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60, collective_timeout=60)
    assert time.monotonic() - start < 30  # far below the 60 s the barrier would wait
    assert info.value.rank == 1
    assert "ValueError: rank one has bad news" in info.value.details
    assert "_fail_on_rank_one" in info.value.details


def test_a_rank_that_dies_without_reporting_is_a_failure():
    with pytest.raises(RankFailed, match="rank 1 failed:\nprocess exited with code 3 without reporting"):
        run_distributed(_exit_silently_on_rank_one, 2, timeout=60, collective_timeout=60)


def test_a_hanging_run_times_out_and_is_killed():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 3 s"):
        run_distributed(_sleep, 1, timeout=3)
    assert time.monotonic() - start < 10


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(lambda: None, 1)
    with pytest.raises(ValueError, match="ranks_per_node = 3 must be positive and divide world_size = 4"):
        run_distributed(_sleep, 4, ranks_per_node=3)
    with pytest.raises(ValueError, match="report_grace: expected seconds >= 0, got -1"):
        run_distributed(_sleep, 1, report_grace=-1)


def test_a_rank_that_cannot_start_reports_its_own_error():
    # The arguments do not pickle, so the first start fails: that error, not one from stopping
    # the ranks that never started, reaches the caller.
    with pytest.raises(Exception, match="pickle") as info:
        run_distributed(_sleep, 2, args=(lambda: None,), timeout=10)
    assert not isinstance(info.value, AssertionError)
