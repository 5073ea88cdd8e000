"""peak_bytes: the step's peak from the profiler's allocator events, pools counted whole."""
import pytest
import torch

from shardmoe.tools.bench.peak_bytes import peak_with_pools, step_peak_bytes
from shardmoe.moe.cpu import Workspace

MIB = 1 << 20


def test_peak_is_the_largest_running_sum_of_allocations_minus_frees():
    kept = []

    def step():
        a = torch.empty(8 * MIB, dtype=torch.uint8)
        b = torch.empty(4 * MIB, dtype=torch.uint8)  # 12 MiB live: the peak
        del a
        c = torch.empty(2 * MIB, dtype=torch.uint8)  # 6 MiB live
        kept.append(c)  # outlives the step, as a gradient does
        del b

    peak = step_peak_bytes(step)
    assert 12 * MIB <= peak < 12 * MIB + 64 * 1024  # a few small bookkeeping tensors at most
    assert len(kept) == 1


def test_reset_runs_outside_the_profile():
    """A block made before the step and freed by reset() is not subtracted from the step."""
    held = [torch.empty(16 * MIB, dtype=torch.uint8)]
    peak = step_peak_bytes(lambda: held.append(torch.empty(MIB, dtype=torch.uint8)), reset=held.clear)
    assert MIB <= peak < MIB + 64 * 1024 and len(held) == 1


def test_pools_count_whole_and_a_growing_pool_is_refused():
    pool = Workspace(min_bytes=0)
    pool.empty((1024, 1024), torch.float32, "cpu")  # a 4 MiB block, free again
    peak = peak_with_pools(lambda: pool.empty((1024, 1024), torch.float32, "cpu"), lambda: None, [pool])
    assert 4 * MIB <= peak < 4 * MIB + 64 * 1024  # the block, lent inside the step, allocates nothing
    sizes = iter(range(2, 10))
    with pytest.raises(RuntimeError, match=r"workspace: still growing after 3 measured steps"):
        peak_with_pools(lambda: pool.empty((next(sizes) * 1024, 1024), torch.float32, "cpu"), lambda: None, [pool])
