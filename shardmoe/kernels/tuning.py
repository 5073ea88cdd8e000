"""Autotune candidates, tuned configs, dot settings and operand layout shared by every kernel launcher.

On a GPU each kernel is autotuned (triton.autotune) over a few tile shapes, keyed on the
weight-shaped sizes that stay fixed for a layer (never on the row count, which changes every step
and would retune every step). Which candidate a key gets, in order:

  1. the config tuned.py holds for this device and key (what a GPU lease's autotuning picked,
     kept as data in the package): no tuning at all;
  2. with shardmoe.settings autotune off, the first candidate;
  3. otherwise triton times every candidate on the first launch of the key.

Under TRITON_INTERPRET=1 there is no timing to learn from, so each kernel gets a single small
config and the autotuner skips all of this.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton import knobs

from shardmoe.kernels import tuned
from shardmoe.settings import SETTINGS

# every kernel that autotune() decorated, by name: tools/gpu_check/tuned.collect reads their choices
AUTOTUNED: dict[str, triton.runtime.Autotuner] = {}


def interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(knobs.runtime.interpret)


def configs(gpu: list[dict], interpreter: dict, warps_stages=((4, 3), (8, 3), (4, 4))) -> list[triton.Config]:
    """The autotune candidates: every `gpu` tile dict crossed with (num_warps, num_stages),
    or only `interpreter` when interpreting."""
    if interpreting():
        return [triton.Config(interpreter, num_warps=1, num_stages=1)]
    return [triton.Config(tiles, num_warps=w, num_stages=s) for tiles in gpu for w, s in warps_stages]


def tuning_key(key_names, named_args: dict) -> tuple:
    """The autotuner's key for a launch, as triton builds it: the values of the `key` arguments, then
    the dtype of every argument that has one, in argument order."""
    values = [named_args[name] for name in key_names if name in named_args]
    values += [str(arg.dtype) for arg in named_args.values() if hasattr(arg, "dtype")]
    return tuple(values)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def current_device_name() -> str | None:
    """The CUDA device's name (the tuned table's first key), None without CUDA."""
    return _device_name(torch.cuda.current_device()) if torch.cuda.is_available() else None


class Prune:
    """early_config_prune of one kernel: the tuned config of this device and key when tuned.py has
    one, else every candidate, or only the first with shardmoe.settings autotune off (each
    candidate is one more compile per kernel variant; a check at many shapes pays that).
    triton prunes only for a key it has not tuned yet and keeps that key's choice for the process:
    the setting holds for the keys first seen while it does, before and after an override alike.
    A tuned config must be one of the candidates: the kernels size buffers from the candidates' tiles
    (down_grad's gate-dot columns from the narrowest BLOCK_N), so a table left over from other
    candidates is refused by name rather than run."""

    def __init__(self, name: str, key_names: list[str]):
        self.name, self.key_names = name, list(key_names)

    def __call__(self, candidates: list, named_args: dict, **kwargs) -> list:
        device = current_device_name()
        if device is not None:
            found = tuned.lookup(device, self.name, tuning_key(self.key_names, {**named_args, **kwargs}))
            if found is not None:
                same = [c for c in candidates if (c.kwargs, c.num_warps, c.num_stages)
                        == (found.kwargs, found.num_warps, found.num_stages)]
                if not same:
                    raise ValueError(
                        f"{tuned.DATA}: expected {self.name}'s tuned config on {device!r} at key "
                        f"{tuned.key_string(tuning_key(self.key_names, {**named_args, **kwargs}))} to be one of its "
                        f"candidates {[(c.kwargs, c.num_warps, c.num_stages) for c in candidates]}, got "
                        f"{(found.kwargs, found.num_warps, found.num_stages)} (merge a new lease's tuned configs)")
                return same
        return candidates if SETTINGS.autotune else candidates[:1]


def autotune(gpu: list[dict], interpreter: dict, key: list[str], warps_stages=((4, 3), (8, 3), (4, 4)), **kwargs):
    """triton.autotune over configs(gpu, interpreter, warps_stages), pruned by Prune, the kernel
    registered in AUTOTUNED under its name."""
    def decorate(fn):
        tuner = triton.autotune(configs=configs(gpu, interpreter, warps_stages), key=key,
                                prune_configs_by={"early_config_prune": Prune(fn.__name__, key)}, **kwargs)(fn)
        AUTOTUNED[fn.__name__] = tuner
        return tuner

    return decorate


def dot_settings(dtype: torch.dtype) -> dict:
    """Constexpr arguments controlling tl.dot.

    DOT_FP32: cast both operands to float32 before the dot. Needed under the interpreter,
      whose bfloat16 dot is wrong; on a GPU bfloat16 operands go to the tensor cores as
      they are (float32 accumulation either way).
    PRECISION: "ieee" for float32 so results match torch's float32 matmul (TF32 off by
      default) instead of TF32's 10-bit mantissa; None (the backend default) otherwise,
      as the setting only concerns float32 operands.
    """
    return {"DOT_FP32": interpreting(), "PRECISION": "ieee" if dtype == torch.float32 else None}


def unit_columns(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is unit-stride (the kernels index columns directly), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()
