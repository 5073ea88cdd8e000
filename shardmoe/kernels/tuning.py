"""Autotune candidates, dot settings and operand layout shared by every kernel launcher.

On a GPU each kernel is autotuned (triton.autotune) over a few tile shapes, keyed on
the weight-shaped sizes that stay fixed for a layer (never on the row count, which
changes every step and would retune every step). Under TRITON_INTERPRET=1 there is no
timing to learn from, so each kernel gets a single small config: the autotuner then
skips benchmarking altogether.
"""
from __future__ import annotations

import torch
import triton
from triton import knobs

from shardmoe.settings import SETTINGS


def interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(knobs.runtime.interpret)


def configs(gpu: list[dict], interpreter: dict, warps_stages=((4, 3), (8, 3), (4, 4))) -> list[triton.Config]:
    """The autotune candidates: every `gpu` tile dict crossed with (num_warps, num_stages),
    or only `interpreter` when interpreting."""
    if interpreting():
        return [triton.Config(interpreter, num_warps=1, num_stages=1)]
    return [triton.Config(tiles, num_warps=w, num_stages=s) for tiles in gpu for w, s in warps_stages]


def first_unless_tuning(candidates: list, named_args: dict, **kwargs) -> list:
    """early_config_prune: every candidate, or only the first with shardmoe.settings autotune off
    (each candidate is one more compile per kernel variant; a check at many shapes pays that).
    triton prunes only for a key (the kernel's `key` sizes and dtypes) it has not tuned yet and
    keeps that key's choice for the process: the setting holds for the keys first seen while it
    does, before and after an override alike."""
    return candidates if SETTINGS.autotune else candidates[:1]


PRUNE = {"early_config_prune": first_unless_tuning}


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
