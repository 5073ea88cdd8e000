"""Benchmark the fused MoE layer: the same run as `shardmoe bench` (see docs/benchmarks.md).

    python benchmarks/bench_moe.py --quick
    python benchmarks/bench_moe.py --shapes e8 --dtype bf16 --json results.json
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from shardmoe.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
