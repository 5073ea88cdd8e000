"""Where a run computes: the device setting resolved on machines with and without GPUs (torch's
view of the GPUs monkeypatched, so the CUDA branches run here too), the process group each device
takes, and the generator states a checkpoint keeps per device."""
import datetime

import pytest
import torch

from shardmoe.train import command
from shardmoe.train.device import process_group_backend, resolve_device, restore_rng_states, rng_states


@pytest.fixture
def gpus(monkeypatch):
    """A machine where torch sees `count` GPUs (set the count on the returned list)."""
    count = [2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count[0] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count[0])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return count


def test_auto_takes_the_gpu_of_the_local_rank_when_torch_sees_one(gpus, monkeypatch):
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("auto", group_device="cpu") == torch.device("cpu")  # a gloo group given: its device
    gpus[0] = 0
    assert resolve_device("auto") == torch.device("cpu")
    assert process_group_backend(torch.device("cuda", 1)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_device_errors_name_the_setting_and_what_to_do(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"^device: the rank with LOCAL_RANK=2 needs GPU 2, but torch sees 2 GPU\(s\) "
                                         r"on this node; launch at most 2 processes per node \(torchrun "
                                         r"--nproc-per-node 2\) or use cpu$"):
        resolve_device("auto")
    with pytest.raises(ValueError, match=r"^device: expected 'cuda' \(the device of the process group the run is "
                                         r"given\) or 'auto', got 'cpu'$"):
        resolve_device("cpu", group_device="cuda")
    gpus[0] = 0
    with pytest.raises(ValueError, match=r"^device: expected a machine with a GPU torch can use for 'cuda' "
                                         r"\(torch.cuda.is_available\(\) is False\); use cpu or auto$"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="^device: expected one of auto, cpu, cuda, got 'tpu'$"):
        resolve_device("tpu")


@pytest.mark.parametrize("setting, backend, index", [("cuda", "nccl", 1), ("cpu", "gloo", None)])
def test_each_rank_sets_its_gpu_and_the_group_is_nccl_on_gpus_gloo_on_the_cpu(gpus, monkeypatch, setting, backend,
                                                                             index):
    """command._init_mesh on rank LOCAL_RANK=1 of 2: on GPUs it makes GPU 1 current, then starts
    NCCL bound to it; on the CPU gloo, no GPU touched (the group's start is recorded, not made)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    calls = []

    class Started(Exception):
        pass

    def init_process_group(name, timeout, device_id):
        calls.append(("init", name, timeout, device_id))
        raise Started

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises(Started):
        command._init_mesh({"p": 1, "d": 2, "e": 1, "t": 1}, 2, 1.5, {"--mesh": "d=2"}, setting)
    gpu = None if index is None else torch.device("cuda", index)
    expected = [("init", backend, datetime.timedelta(minutes=1.5), gpu)]
    assert calls == ([("set_device", gpu)] if gpu is not None else []) + expected


def test_a_checkpoint_keeps_the_cpu_generator_and_the_gpus_of_a_run_on_one(monkeypatch):
    state = {"cuda": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: state["cuda"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: state.update(cuda=s, set_on=d))
    gpu = torch.device("cuda", 1)
    assert set(rng_states(torch.device("cpu"))) == {"rng.torch"}
    saved = rng_states(gpu)
    assert set(saved) == {"rng.torch", "rng.cuda"} and torch.equal(saved["rng.cuda"], state["cuda"])
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    states = rng_states(gpu) | {"rng.cuda": torch.full((16,), 7, dtype=torch.uint8)}
    torch.rand(5)
    restore_rng_states(states, torch.device("cpu"))  # a CPU run takes the CPU generator only
    assert torch.equal(torch.rand(2), expected) and "set_on" not in state
    restore_rng_states(states, gpu)
    assert state["set_on"] == gpu and torch.equal(state["cuda"], states["rng.cuda"])
    restore_rng_states({"rng.torch": states["rng.torch"]}, gpu)  # written on the CPU: the GPU's stays as seeded
    assert torch.equal(state["cuda"], states["rng.cuda"])
