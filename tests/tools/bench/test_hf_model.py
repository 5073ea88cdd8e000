"""`shardmoe bench --hf FAMILY --model`: a row per candidate, the check against eager (loss and
gradients), and the refused flag combinations. Nothing here asserts on a timing: the quick mode
times one step per candidate, which says nothing about speed."""
from __future__ import annotations

import math

import pytest
import torch

from shardmoe.tools.bench import main

pytest.importorskip("transformers")

CANDIDATES = ("shardmoe", "grouped_mm", "eager", "convert")
# one thread: the steps are tiny, and two OpenMP threads on a loaded machine wait on each other
QUICK = ["--model", "--quick", "--dtype", "fp32", "--threads", "1"]


@pytest.fixture
def keep_threads():
    """--threads calls torch.set_num_threads for the whole process: put the setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def rows(out: str, family: str) -> dict[str, list[str]]:
    """The table's rows of one family, by candidate: [ms, x/shardmoe, x/convert, loss, dloss, grad err]."""
    table = [line.split() for line in out.splitlines() if line.startswith(family + " ")]
    return {r[2]: r[3:] for r in table}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_model_bench_rows(family, capsys, keep_threads):
    assert main(["--hf", family, *QUICK]) == 0
    out = capsys.readouterr().out
    table = rows(out, family)
    assert tuple(table) == CANDIDATES
    for name, (ms, over_shardmoe, over_convert, loss, dloss, grad_err) in table.items():
        ratios = float(over_shardmoe.rstrip("x")), float(over_convert.rstrip("x"))
        assert float(ms) > 0 and all(math.isfinite(r) and r > 0 for r in ratios), (name, ratios)
        # fp32: the same model's loss and gradients, computed four ways, to float32 round-off
        assert math.isfinite(float(loss)) and float(dloss) < 1e-5, (name, loss, dloss)
        assert float(grad_err) < 1e-5, (name, grad_err)
    assert table["shardmoe"][1] == "1.00x" and table["convert"][2] == "1.00x"


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])  # shared experts; interleaved, transposed weights
def test_model_bench_maps_converted_gradients_to_the_family(family):
    """convert's gradients are compared under the family's names: a name left unmapped would be nan."""
    from shardmoe.tools.bench import hf_model as model_bench

    sizes = {**model_bench.DEFAULTS, **model_bench.QUICK}
    result = model_bench.run_model(family, "fp32", **sizes)
    assert result["grad_err_vs_eager"]["convert"] < 1e-5
    assert max(result["loss_rel_diff_vs_eager"].values()) < 1e-5


@pytest.mark.parametrize("argv, named", [
    (["--hf", "mixtral", *QUICK, "--tokens", "64"], "--tokens"),
    (["--hf", "mixtral", *QUICK, "--top-k", "9"], "--top-k"),
    (["--hf", "mixtral", *QUICK, "--seq-len", "0"], "--seq-len"),
    (["--hf", "mixtral", "--quick", "--batch", "2"], "--batch"),
    (["--model", "--quick"], "--model"),
    (["--hf", "llama", *QUICK], "--hf"),
])
def test_model_bench_refuses_bad_flags(argv, named, capsys, keep_threads):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardmoe bench: {named}: expected"), err
