"""benchmarks/model_share.py: the experts' share of a whole-model step (a smoke run; no timing
is asserted, only that every figure is there and a share is a fraction)."""
import importlib.util
import pathlib
import re


def _script():
    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "model_share.py"
    spec = importlib.util.spec_from_file_location("model_share", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_both_implementations_and_the_dense_bound(hf, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        _script().main(["--family", "mixtral", "--dtype", "fp32", "--threads", "1", "--quick"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for impl in ("grouped_mm", "shardmoe"):
        row = re.search(rf"^{impl}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", out, re.M)
        assert row, out
        step, inside, share = map(float, row.groups())
        assert 0 < inside <= step and 0 < share <= 1
    assert re.search(r"dense anchor: [\d.]+ ms .* step ([\d.]+)x grouped_mm's", out), out
