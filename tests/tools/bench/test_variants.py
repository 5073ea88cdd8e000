"""shardmoe's ablations in the bench (before/after lines of docs/benchmarks.md), the fine-grained
shape, fresh routing by default, and the workspace column."""
from __future__ import annotations

from shardmoe.tools import bench
from shardmoe.tools.bench.candidates import VARIANTS
from shardmoe.tools.bench.case import run_case
from shardmoe.tools.bench.flops import SHAPES, Shape
from shardmoe.tools.bench.report import format_case


def test_variants_agree_with_the_layer_and_report_their_workspace():
    s = Shape(tokens=64, hidden=32, ffn=64, experts=4, top_k=2)
    r = run_case("tiny", s, "bf16", "cpu", warmup=1, repeats=1, names=("shardmoe", *VARIANTS), routing="fresh")
    rows = {row.candidate: row for row in r.rows}
    assert set(rows) == {"shardmoe", *VARIANTS}
    assert rows["shardmoe:no-workspace"].workspace_bytes_per_token == 0
    # these tiny buffers stay under the pool's threshold: allocated by torch, nothing resident
    assert rows["shardmoe"].workspace_bytes_per_token == 0
    text = format_case(r)
    assert "ws B/tok" in text and all(name in text for name in VARIANTS)


def test_fresh_routing_is_the_default_and_fine_is_a_shape(capsys):
    assert SHAPES["fine"][3] >= 64 and 4 <= SHAPES["fine"][4] <= 8
    code = bench.main(["--shapes", "fine", "--tokens", "16", "--hidden", "32", "--ffn", "16", "--experts", "8",
                       "--dtype", "fp32", "--repeats", "1", "--warmup", "1", "--threads", "1",
                       "--candidates", "dense", "shardmoe", "shardmoe:no-workspace"])
    assert code == 0
    out = capsys.readouterr().out
    assert "[fine fp32] S=16 H=32 F=16 E=8 k=8" in out and "fresh routing" in out
