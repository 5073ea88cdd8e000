"""Where a run computes: the `device` setting resolved to a torch.device, and the process group's
backend for it.

    auto   a GPU when torch sees one (torch.cuda.is_available()), else the CPU
    cpu    the CPU; several ranks talk over gloo
    cuda   a GPU; refused by name when torch sees none
Under torchrun each rank of a node takes GPU LOCAL_RANK (torch.cuda.set_device, so that NCCL and
every tensor without an explicit index use it) and the ranks talk over NCCL; a rank whose
LOCAL_RANK has no GPU is refused by name. With a process group another caller made (train() from
Python under a mesh), `auto` takes the group's device type (cuda under NCCL, cpu under gloo) and an
explicit setting must agree with it.

A checkpoint keeps the generator states of the devices a run draws from (rng_states): the CPU's,
and its GPU's when it computes on one.
"""
from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cpu", "cuda")


def check_device(setting) -> str:
    if setting not in DEVICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {setting!r}")
    return setting


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(setting: str, group_device: str | None = None) -> torch.device:
    """The torch.device a run with device=`setting` computes on. group_device: the device type of
    the process group the run is given ("cuda" under NCCL, "cpu" under gloo; None without one).
    ValueError naming the setting for cuda without a GPU, a LOCAL_RANK past the GPUs, or a
    setting another than the group's."""
    check_device(setting)
    kind = setting
    if setting == "auto":
        kind = group_device or ("cuda" if torch.cuda.is_available() else "cpu")
    elif group_device is not None and group_device != kind:
        raise ValueError(f"device: expected {group_device!r} (the device of the process group the run is given) "
                         f"or 'auto', got {setting!r}")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device: expected a machine with a GPU torch can use for 'cuda' (torch.cuda.is_available() "
                         "is False); use cpu or auto")
    index, count = local_rank(), torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device: the rank with LOCAL_RANK={index} needs GPU {index}, but torch sees {count} "
                         f"GPU(s) on this node; launch at most {count} processes per node "
                         f"(torchrun --nproc-per-node {count}) or use cpu")
    return torch.device("cuda", index)


def process_group_backend(device: torch.device) -> str:
    """The torch.distributed backend between ranks computing on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """{"rng.torch": the CPU generator's state, "rng.cuda": the GPU's of a run on `device` a GPU} (uint8)."""
    states = {"rng.torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["rng.cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set the generators from rng_states' entries: the CPU's, and the GPU's when the run computes on
    one and `states` has it (a checkpoint written on the CPU has none: the seeded state stays)."""
    torch.set_rng_state(states["rng.torch"])
    if device.type == "cuda" and "rng.cuda" in states:
        torch.cuda.set_rng_state(states["rng.cuda"], device)
