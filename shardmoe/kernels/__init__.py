"""Triton kernels for the MoE layer's CUDA path.

shardmoe/moe/dispatch.py's select() picks the ops once per forward: TritonOps
(shardmoe/moe/triton_ops.py, over shardmoe.kernels.stages and .combine) when kernel_path(config, x)
says so (see docs/kernels.md for the map). This module itself never imports triton unless a
kernel runs, so CPU-only installs without triton import it freely.

SHARDMOE_KERNELS=0 (or shardmoe.settings.override(kernels=False)) keeps every stage on the torch
path (to compare the two); the test switch force_kernels (shardmoe.settings) takes every layer the
kernels implement to them, CPU tensors included (Triton's interpreter).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from shardmoe.settings import SETTINGS

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# activations.activation's branches: every activation the layer has (expert_kinds.py ACTIVATIONS; a
# test holds the two equal), and for "glu" the clamped SwiGLU besides (activations.glu)
KERNEL_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "identity")

# The widest expert (F) the kernels take by default: a value kept until the lease's sweep
# (python -m shardmoe.tools.gpu_check --only lease) measures where these kernels stop winning. What
# it rests on, H100 runs of earlier kernels (ahead of the torch path up to F = 2048, behind
# cuBLAS at F = 14336), is in docs/kernels.md ("Which layers take the kernels") with its command.
# 4096 keeps DeepSeek-V3 (2048), GPT-OSS (2880) and Qwen3 (768, 1536) on the kernels and sends
# Mixtral-sized experts to cuBLAS.
KERNEL_MAX_FFN = 4096


@functools.cache
def triton_importable() -> bool:
    """Whether `import triton` succeeds here (checked once per process)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install fails in many ways; any of them means "no"
        return False
    return True


def available(tensor: torch.Tensor) -> bool:
    """True when the Triton kernels should handle this tensor: a kernel dtype (float32 or bfloat16),
    triton importable, SETTINGS.kernels on, and a CUDA tensor, or any tensor under the test switch
    SETTINGS.force_kernels (CPU tensors then run in Triton's interpreter, a test vehicle far too
    slow for real CPU work: TRITON_INTERPRET=1 alone sends none there)."""
    return (
        (tensor.is_cuda or SETTINGS.force_kernels)
        and tensor.dtype in KERNEL_DTYPES
        and SETTINGS.kernels
        and triton_importable()
    )


def router_path(*tensors: torch.Tensor) -> bool:
    """Whether the router's GEMMs (moe/routing.py) run on router_gemm.router_mm: every tensor
    available(); never where autograd would record the call (the kernel has no backward)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(available(t) for t in tensors)


def kernel_path(config, x: torch.Tensor, expert_width: int | None = None) -> bool:
    """The one predicate for "do the kernels take this layer?".

    True when x is available() and the experts' GEMMs are at most KERNEL_MAX_FFN wide:
    `expert_width`, the intermediate width this rank computes (F/t under expert tensor
    parallelism; config.ffn_size when not given). The kernels implement every expert kind, bias,
    activation (the clamped SwiGLU included) and capacity drop that MoEConfig accepts.
    The router (every score function, bias and loss; its three GEMMs on router_gemm where
    router_path() says so) and a shared expert (a dense GEMM pair over all tokens,
    moe/shared_experts.py) run beside the kernels on every path. The one condition on the layer
    is measured speed: wider experts go to the torch path, whose cuBLAS GEMMs were faster there
    (SETTINGS.force_kernels overrides it).
    """
    if SETTINGS.force_kernels:
        return available(x)
    return available(x) and (config.ffn_size if expert_width is None else expert_width) <= KERNEL_MAX_FFN
