"""`shardmoe bench --hf FAMILY`: the rows it prints, the check against eager, and its refusals."""
from __future__ import annotations

import pytest

from shardmoe.tools.bench import main

pytest.importorskip("transformers")

TINY = ["--tokens", "24", "--hidden", "16", "--ffn", "8", "--experts", "4", "--warmup", "0", "--repeats", "1",
        "--dtype", "fp32"]


def test_bench_family_row(capsys):
    assert main(["--hf", "deepseek_v3", *TINY]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("deepseek_v3"))
    ms_shardmoe, ms_grouped, ms_eager = (float(v) for v in row.split()[2:5])
    assert min(ms_shardmoe, ms_grouped, ms_eager) > 0
    assert float(row.split()[-1]) < 1e-5  # shardmoe's output and gradients against eager, fp32


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])  # gpt_oss: its block returns (out, router scores)
def test_bench_checks_shardmoe_and_grouped_mm_against_eager(family):
    from shardmoe.tools.bench import hf_block as hf_bench

    result = hf_bench.run_family(family, "fp32", tokens=24, hidden=16, ffn=8, experts=4, top_k=2, warmup=0,
                                 repeats=1)
    assert result["rel_err_vs_eager"]["shardmoe"] < 1e-5 and result["rel_err_vs_eager"]["grouped_mm"] < 1e-5
    assert result["grouped_mm_over_shardmoe"] > 0 and result["eager_over_shardmoe"] > 0


def test_bench_refuses_unknown_families(capsys):
    assert main(["--hf", "llama", *TINY]) == 2
    assert "--hf: expected one of mixtral" in capsys.readouterr().err
