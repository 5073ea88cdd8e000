"""The whole suite's Triton mode, set before any test module is imported.

triton.jit reads TRITON_INTERPRET when a function is decorated, triton.language's own helpers
included, and importing shardmoe imports triton (through torch's custom-op machinery). So the
mode must be chosen here, in the first conftest pytest loads: a test module collected earlier
would otherwise fix triton in compiled mode, and every interpreted kernel calling one of triton's
own jit helpers would fail ("Cannot call @triton.jit'd outside of the scope of a kernel").
SHARDMOE_TEST_COMPILED: 0 or unset, Triton's interpreter on CPU tensors (what `make test` runs,
on any machine); 1, compiled kernels on CUDA tensors (python -m shardmoe.tools.gpu_check's tests stage;
tests/kernels/conftest.py skips the interpreter-only modules)."""
import os

import pytest
import torch

COMPILED = os.environ.get("SHARDMOE_TEST_COMPILED", "0")
if COMPILED not in ("0", "1"):
    raise pytest.UsageError(f"SHARDMOE_TEST_COMPILED: expected 0 (interpreter) or 1 (compiled on CUDA), "
                            f"got {COMPILED!r}")
if COMPILED == "0":
    os.environ["TRITON_INTERPRET"] = "1"
elif not torch.cuda.is_available():
    raise pytest.UsageError("SHARDMOE_TEST_COMPILED=1: expected a CUDA device (torch.cuda.is_available()), got none")
elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise pytest.UsageError(f"SHARDMOE_TEST_COMPILED=1: expected TRITON_INTERPRET unset or 0, got "
                            f"{os.environ['TRITON_INTERPRET']!r}")
