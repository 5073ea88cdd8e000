"""The expert-parallel benchmark (`shardmoe bench --mesh`, distributed.py) on one process: its one-rank
baseline runs without torchrun, and its options compose with the single-process bench's parser. Its
two-rank run is checked inside tests/parallel/test_expert_parallel.py's 2-rank world (a spawn costs seconds)."""
import json
from types import SimpleNamespace

import torch.distributed as dist

from shardmoe.tools.bench import distributed


def test_benchmark_runs_one_rank_without_torchrun(tmp_path):
    report_path = tmp_path / "report.json"
    args = SimpleNamespace(mesh=None, quick=True, dtype="fp32", json=str(report_path), device="cpu", threads=None)
    assert distributed.run_distributed(args) == 0
    assert not dist.is_initialized()  # it tears down the group it made
    (report,) = json.loads(report_path.read_text())
    assert report["world"] == 1 and list(report["paths"]) == ["local"]
    assert report["paths"]["local"]["tokens_per_s_per_rank"] > 0


def test_benchmark_options_compose_with_the_single_process_bench_parser():
    import argparse

    from shardmoe.tools import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    distributed.add_arguments(parser)  # adds only what the parser lacks
    args = parser.parse_args(["--mesh", "e=4", "--quick", "--threads", "1", "--hidden", "32"])
    assert (args.mesh, args.quick, args.threads, args.hidden, args.top_k) == ("e=4", True, 1, 32, None)
