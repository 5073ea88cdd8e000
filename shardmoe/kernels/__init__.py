"""Triton kernels for the fused MoE layer's CUDA path.

shardmoe/moe/backends.py picks the implementation once per forward: its Triton backend
(shardmoe/moe/triton_backend.py, over shardmoe.kernels.stages and .combine) when
fused_path(config, x) says so (see docs/kernels.md for the map). This module itself
never imports triton unless a kernel runs, so CPU-only installs without triton import it
freely.

SHARDMOE_KERNELS=0 (or shardmoe.settings.override(kernels=False)) keeps every stage on the torch
path (to compare the two).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

from shardmoe.settings import SETTINGS

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# activations.activation's branches: every activation the layer has (expert_kinds.py ACTIVATIONS; a
# test holds the two equal), and for "glu" the clamped SwiGLU besides (activations.glu)
KERNEL_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "identity")

# The widest expert (F) the kernels take by default. Measured on an H100 with earlier kernels (bf16,
# forward + backward, docs/kernels.md): at F=256 (E=128, k=8) the kernels were 2.2x the torch path,
# at F=14336 (E=8, k=2) the torch path (cuBLAS GEMMs) was 2.1x the kernels; with dh formed once they
# led up to F=2048 (1.08x), wider widths not reached. The lease's sweep (gpu_check --only lease)
# measures the crossover of these kernels; until it has, 4096 keeps DeepSeek-V3 (2048), GPT-OSS
# (2880) and Qwen3 (768, 1536) on the kernels and sends Mixtral-sized experts to cuBLAS.
KERNEL_MAX_FFN = 4096

FORCED = False  # set only by force_kernel_path(), a test and measurement switch


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


def available(tensor: torch.Tensor, cuda_only: bool = True) -> bool:
    """True when the Triton kernels should handle this tensor: a CUDA tensor of a
    kernel dtype (float32 or bfloat16), triton importable, shardmoe.settings.SETTINGS.kernels on.

    CPU tensors always get False, even under TRITON_INTERPRET=1: the interpreter is
    a test vehicle, far too slow to route real CPU work through (cuda_only=False is
    force_kernel_path's way past that, for tests).
    """
    return (
        (tensor.is_cuda or not cuda_only)
        and tensor.dtype in KERNEL_DTYPES
        and SETTINGS.kernels
        and triton_importable()
    )


@contextlib.contextmanager
def force_kernel_path():
    """Test and measurement switch: inside it, fused_path() takes every layer past KERNEL_MAX_FFN
    (to time the kernels where the torch path is the default) and also accepts CPU tensors, so the
    wiring runs the Triton kernels under TRITON_INTERPRET=1 (tests/kernels/ sets it).
    `available()` is unaffected: normal CPU use never reaches the interpreter.
    """
    global FORCED
    previous, FORCED = FORCED, True
    try:
        yield
    finally:
        FORCED = previous


def router_path(*tensors: torch.Tensor) -> bool:
    """Whether the router's GEMMs (moe/routing.py) run on router_gemm.router_mm: every tensor a kernel
    dtype on CUDA with the kernels on (available()), on any device inside force_kernel_path(); never
    where autograd would record the call (the kernel has no backward)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(available(t, cuda_only=not FORCED) for t in tensors)


def fused_path(config, x: torch.Tensor, expert_width: int | None = None) -> bool:
    """The one predicate for "does the fused kernel path take this layer?".

    True when x is a kernel dtype on CUDA (or on CPU inside force_kernel_path()), triton is
    importable, SETTINGS.kernels is on and the experts' GEMMs are at most KERNEL_MAX_FFN wide:
    `expert_width`, the intermediate width this rank computes (F/t under expert tensor
    parallelism; config.ffn_size when not given). The kernels implement every expert kind, bias,
    activation (the clamped SwiGLU included) and capacity drop that MoEConfig accepts.
    The router (every score function, bias and loss; its three GEMMs on router_gemm where
    router_path() says so) and a shared expert (a dense GEMM pair over all tokens,
    moe/shared_experts.py) run beside the backend on every path. The one
    condition on the layer is measured speed: wider experts go to the torch path, whose cuBLAS
    GEMMs were faster there (force_kernel_path() overrides it).
    """
    if FORCED:
        return available(x, cuda_only=False)
    return available(x) and (config.ffn_size if expert_width is None else expert_width) <= KERNEL_MAX_FFN
