"""The parallel package on one process: a one-rank mesh is the fused layer, and the benchmark's
one-rank baseline runs without torchrun."""
import json
from types import SimpleNamespace

import torch
import torch.distributed as dist

import shardmoe
from shardmoe.parallel import bench, sync_grads


def test_a_one_rank_mesh_is_the_single_process_layer():
    torch.manual_seed(0)
    plain = shardmoe.MoE(8, 6, 4, 2, capacity_factor=1.0, aux_loss_coef=0.1, dtype=torch.float64)
    torch.manual_seed(0)
    meshed = shardmoe.MoE(8, 6, 4, 2, capacity_factor=1.0, aux_loss_coef=0.1, dtype=torch.float64,
                          mesh=shardmoe.Mesh())
    x = torch.randn(9, 8, dtype=torch.float64)
    for layer in (plain, meshed):
        (layer(x).square().sum() + layer.aux_loss).backward()
    sync_grads(meshed, meshed.mesh)
    assert meshed.local_experts == range(4)
    for (name, a), (_, b) in zip(plain.named_parameters(), meshed.named_parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad), name
    assert torch.equal(plain.stats["tokens_per_expert"], meshed.stats["tokens_per_expert"])


def test_benchmark_runs_one_rank_without_torchrun(tmp_path):
    report_path = tmp_path / "report.json"
    args = SimpleNamespace(mesh=None, quick=True, dtype="fp32", json=str(report_path), device="cpu", threads=None)
    assert bench.run_distributed(args) == 0
    assert not dist.is_initialized()  # it tears down the group it made
    (report,) = json.loads(report_path.read_text())
    assert report["world"] == 1 and list(report["paths"]) == ["local"]
    assert report["paths"]["local"]["tokens_per_s_per_rank"] > 0


def test_benchmark_options_compose_with_the_single_process_bench_parser():
    import argparse

    from shardmoe import bench as single_process_bench

    parser = argparse.ArgumentParser()
    single_process_bench.add_arguments(parser)
    bench.add_arguments(parser)  # adds only what the parser lacks
    args = parser.parse_args(["--mesh", "e=4", "--quick", "--threads", "1", "--hidden", "32"])
    assert (args.mesh, args.quick, args.threads, args.hidden, args.top_k) == ("e=4", True, 1, 32, None)


def test_select_rows_moves_whole_words_and_equals_byte_indexing():
    """Row widths that 8, 4, 2 and only 1 divide, and a buffer that starts off a word boundary
    (which falls back to bytes): always data[index]."""
    from shardmoe.parallel.exchange import select_rows
    gen = torch.Generator().manual_seed(0)
    index = torch.randperm(7, generator=gen)
    for width in (1024, 1028, 1026, 1027, 0):
        data = torch.randint(0, 256, (7, width), dtype=torch.uint8, generator=gen)
        assert torch.equal(select_rows(data, index), data[index]), width
    flat = torch.randint(0, 256, (7 * 16 + 1,), dtype=torch.uint8, generator=gen)
    unaligned = flat[1:].view(7, 16)  # 16-byte rows one byte past an 8-byte boundary
    assert torch.equal(select_rows(unaligned, index), unaligned[index])
