"""The dtype an MoE computes in, inside torch.autocast and outside it.

Outside autocast nothing is cast: x must have the parameters' dtype, and every stage runs in it
(with float32 accumulation for bf16 / fp16, rows.accumulation_dtype).

Inside torch.autocast(device_type, dtype=D), D bf16 or fp16, with parameters of dtype P in
{float32, bfloat16, float16} (float64 is left alone, as autocast leaves float64 ops alone):
  router       logits, scores, top-k, renormalisation, balance losses and stage 6 in float32:
               the gate weight [H, E] and router bias [E] are not cast, and the router promotes
               x to its accumulation dtype, float32
  experts      x [S, H] and the expert (and shared-expert) weights are cast to D before the MoE
               operator, so the expert GEMMs and elementwise passes run in D with float32
               accumulation, and the output [S, H] is D (as an autocast nn.Linear's is)
  gradients    land in P: the casts are autograd ops, whose backward casts D back to P
The MoE operators themselves run with autocast off (moe/function.py, autocast_off): autocast would otherwise cast
the router's GEMM, inside the operator, to D.
This mirrors torchtitan's float32 gate under autocast and Megatron's --moe-router-dtype fp32.
"""
from __future__ import annotations

import contextlib

import torch

# the dtypes autocast may ask the expert GEMMs to run in
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
# the parameter and input dtypes autocast casts (float64 is never autocast)
CASTABLE = (torch.float32, torch.bfloat16, torch.float16)


@torch.compiler.assume_constant_result
def autocast_available(device_type: str) -> bool:
    """torch.amp.is_autocast_available(device_type), which torch.compile takes as a constant of the
    device type: torch 2.11's Dynamo cannot trace that builtin (a graph break, an error under
    fullgraph=True)."""
    return torch.amp.is_autocast_available(device_type)


def autocast_off(device_type: str):
    """torch.autocast(device_type, enabled=False); nothing on a device autocast does not know (meta,
    whose tensors run a step's shapes without data: torch.autocast refuses it)."""
    if not autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def autocast_dtype(x: torch.Tensor, param_dtype: torch.dtype) -> torch.dtype | None:
    """D, the dtype the experts compute in under an autocast enabled for x's device; None when
    there is none or the parameters are not castable (float64), so nothing is cast.

    Raises ValueError for an autocast dtype the experts have no kernels for (float32 autocast
    or a float8 one, say), naming it, before any work."""
    device_type = x.device.type
    if not autocast_available(device_type) or not torch.is_autocast_enabled(device_type) \
            or param_dtype not in CASTABLE:
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"torch.autocast: expected dtype among {', '.join(map(str, AUTOCAST_DTYPES))} for the "
                         f"MoE's expert GEMMs, got {dtype}")
    if x.dtype not in CASTABLE:
        raise ValueError(f"x: expected dtype among {', '.join(map(str, CASTABLE))} under torch.autocast "
                         f"({dtype}), got {x.dtype}")
    return dtype


def cast(tensors, dtype: torch.dtype | None) -> list:
    """tensors with each floating one cast to dtype (None and integer tensors as they are)."""
    if dtype is None:
        return list(tensors)
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors]
