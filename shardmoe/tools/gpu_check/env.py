"""Stage env: where the report was measured.

Versions (python, torch, triton, transformers, the CUDA torch was built with, the NVIDIA driver
as torch's collect_env reads it), the device (name, memory, SMs, compute capability), the float32
matmul settings that decide whether fp32 GEMMs run as TF32, and the tools the sanitizer stage uses.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from .report import table


def _tool_version(name: str) -> str | None:
    """The last line of `name --version`, None when the tool is not on PATH."""
    path = shutil.which(name)
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"{path} (--version failed: {err})"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return f"{path}: {lines[-1] if lines else 'no output'}"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception as err:  # an absent or broken install: the report says which
        return f"not importable ({type(err).__name__}: {err})"


def run(ctx) -> dict:
    import platform

    import torch
    from torch.utils import collect_env

    from shardmoe import kernels
    from shardmoe.tools.bench.report import environment

    result = {
        "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
        "triton_importable": kernels.triton_importable(), "transformers": _version("transformers"),
        "cuda_runtime": torch.version.cuda, "driver": collect_env.get_nvidia_driver_version(collect_env.run),
        "cuda_available": torch.cuda.is_available(), "device": ctx.device, "dry_run": ctx.dry_run,
        "cpu_count": os.cpu_count(), "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "compute_sanitizer": _tool_version("compute-sanitizer"), "ncu": _tool_version("ncu"),
    }
    try:  # the bench's own record (commit, CPU model, threads); it needs transformers
        result["commit"] = environment()["commit"]
    except ImportError as err:
        result["commit"] = f"unknown ({err})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result.update(device_name=props.name, memory_gib=props.total_memory / 2 ** 30,
                      sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                      device_count=torch.cuda.device_count())
    print("  " + ", ".join(f"{k}={result.get(k)}" for k in ("device_name", "torch", "triton", "cuda_runtime",
                                                             "driver", "memory_gib", "sms")), flush=True)
    return result


def markdown(result: dict) -> list[str]:
    return table(["what", "value"], [[key, value] for key, value in result.items()])
