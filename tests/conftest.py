"""The whole suite's Triton mode, set before any test module is imported.

triton.jit reads TRITON_INTERPRET when a function is decorated, triton.language's own helpers
included, and importing shardmoe imports triton (through torch's custom-op machinery). So the
interpreter must be chosen here, in the first conftest pytest loads, not in tests/kernels/: a test
module collected earlier would otherwise fix triton in compiled mode, and every interpreted kernel
calling one of triton's own jit helpers would fail ("Cannot call @triton.jit'd outside of the scope
of a kernel"). SHARDMOE_TEST_COMPILED=1 (tests/kernels/conftest.py checks it) leaves it unset:
compiled kernels on CUDA tensors."""
import os

if os.environ.get("SHARDMOE_TEST_COMPILED", "0") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
