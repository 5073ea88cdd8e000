"""The switches that choose between shardmoe's implementations, in one object.

Each is read once from its environment variable when shardmoe is imported (a value of 0 turns it
off, any other on; unset, the default below) and may be changed for a block of code with
override(). Each stays for the measurement named beside it, which needs the other side to compare
against:

  kernels            SHARDMOE_KERNELS            the Triton kernels on CUDA (moe/dispatch.py); the GPU
                                                 check's bench and sweep time it against the torch path
                                                 (docs/gpu.md)
  experts_mm         SHARDMOE_EXPERTS_MM         the experts' GEMMs side by side on CPU (moe/cpu.py); the
                                                 layer bench's =0 / =1 pair measured it (docs/benchmarks.md,
                                                 "What the figures settle on the CPU")
  fused_elementwise  SHARDMOE_FUSED_ELEMENTWISE  the C++ elementwise passes on CPU (moe/cpu.py); off, the
                                                 torch code the passes are held to bit for bit
                                                 (tests/moe/test_cpu_elementwise.py)
  autotune           SHARDMOE_AUTOTUNE           the Triton kernels try every tile config on a new shape;
                                                 off, each takes its first (kernels/tuning.py): for
                                                 checks at many small shapes, where compiling dominates;
                                                 a shape keeps its first choice for the process
  force_kernels      SHARDMOE_FORCE_KERNELS      off by default; on, every layer the kernels implement
                                                 takes them (kernels.kernel_path): past KERNEL_MAX_FFN,
                                                 to time the kernels where the torch path is the
                                                 default (the GPU check's bench), and for CPU tensors,
                                                 which then run in Triton's interpreter (the kernel
                                                 tests, tests/kernels/)

  with shardmoe.settings.override(fused_elementwise=False):
      layer(x).sum().backward()          # the torch code of the same stages

Every switch only chooses how a result is computed, never what it is: outputs and gradients agree
to round-off either way (the tests hold each path to the float64 reference).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

ENVIRONMENT = {"kernels": "SHARDMOE_KERNELS", "experts_mm": "SHARDMOE_EXPERTS_MM",
               "fused_elementwise": "SHARDMOE_FUSED_ELEMENTWISE", "autotune": "SHARDMOE_AUTOTUNE",
               "force_kernels": "SHARDMOE_FORCE_KERNELS"}


@dataclasses.dataclass
class Settings:
    kernels: bool = True
    experts_mm: bool = True
    fused_elementwise: bool = True
    autotune: bool = True
    force_kernels: bool = False

    @classmethod
    def from_environ(cls) -> "Settings":
        """Each switch from its variable: set to 0, off; set to anything else, on; unset, its default."""
        defaults = cls()
        return cls(**{name: os.environ[var] != "0" if var in os.environ else getattr(defaults, name)
                      for name, var in ENVIRONMENT.items()})


SETTINGS = Settings.from_environ()


@contextlib.contextmanager
def override(**changes: bool):
    """SETTINGS with `changes` applied inside the block, restored after it (also on an error)."""
    unknown = sorted(set(changes) - set(ENVIRONMENT))
    if unknown:
        raise ValueError(f"override: expected settings among {', '.join(ENVIRONMENT)}, got {unknown}")
    bad = {k: v for k, v in changes.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"override: expected bool values, got {bad}")
    previous = dataclasses.asdict(SETTINGS)
    for name, value in changes.items():
        setattr(SETTINGS, name, value)
    try:
        yield SETTINGS
    finally:
        for name, value in previous.items():
            setattr(SETTINGS, name, value)
