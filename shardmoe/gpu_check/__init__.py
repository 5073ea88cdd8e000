"""The old name of `python -m shardmoe.tools.gpu_check`, kept for one release: it only forwards.

Lease commands written as `python -m shardmoe.gpu_check --out $OUT --only lease` keep running;
docs/gpu.md shows the new one."""
from shardmoe.tools.gpu_check import main

__all__ = ["main"]
