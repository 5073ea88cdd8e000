"""Shared by the `shardmoe bench` tests: one torch thread."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Nothing here is timed against a bar; one thread keeps the tests quick on a busy machine
    (two OpenMP threads wait on each other whenever a core is taken by another process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
