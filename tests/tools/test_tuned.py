"""python -m shardmoe.tools.gpu_check.tuned: a lease's autotuned configs collected, written and merged
into the table the kernels read (shardmoe/kernels/tuned.py), and looked up from it."""
import json

import pytest

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

import triton  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from shardmoe.kernels import tuned, tuning  # noqa: E402
from shardmoe.tools.gpu_check import tuned as tool  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"


def test_tuned_configs_are_collected_written_and_merged(tmp_path, monkeypatch, capsys):
    assert tuned.read(tuned.DATA) == tuned.TABLE  # the package's file parses (it may be empty)
    config = triton.Config({"BLOCK_O": 128, "BLOCK_K": 256, "BLOCK_R": 64}, num_warps=8, num_stages=3)
    fake = Autotuner.__new__(Autotuner)
    fake.cache = {(512, 1536, "identity", "torch.bfloat16"): config}
    monkeypatch.setitem(tuning.AUTOTUNED, "weight_grad_kernel", fake)
    chosen = tool.collect()
    entry = {"kwargs": {"BLOCK_O": 128, "BLOCK_K": 256, "BLOCK_R": 64}, "num_warps": 8, "num_stages": 3}
    assert chosen["weight_grad_kernel"] == {"512|1536|identity|torch.bfloat16": entry}
    first, second, target = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "tuned_configs.json"
    tool.write(first, H100, chosen)
    tool.write(second, H100, {"weight_grad_kernel": {"512|1536|identity|torch.bfloat16": {**entry, "num_stages": 4},
                                                      "1|2|relu|torch.bfloat16": entry}})
    assert tool.main(["--merge", str(first), str(second), "--into", str(target)]) == 0
    merged = json.loads(target.read_text())
    keys = merged["devices"][H100]["weight_grad_kernel"]
    assert merged["format"] == tuned.FORMAT and len(keys) == 2
    assert keys["512|1536|identity|torch.bfloat16"]["num_stages"] == 4  # the later file wins
    assert f"{H100}: 2 keys" in capsys.readouterr().out
    monkeypatch.setattr(tuned, "TABLE", tuned.read(target))
    found = tuned.lookup(H100, "weight_grad_kernel", (1, 2, "relu", "torch.bfloat16"))
    assert found.kwargs == entry["kwargs"] and found.num_warps == 8
    assert tuned.lookup(H100, "weight_grad_kernel", (3, 2, "relu", "torch.bfloat16")) is None


def test_a_broken_tuned_file_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": {}}')
    with pytest.raises(ValueError, match="expected a tuned-configs file of format 1"):
        tuned.read(bad)
    assert tool.main(["--merge", str(bad), "--into", str(tmp_path / "t.json")]) == 2
    assert "bad.json: expected a tuned-configs file of format 1" in capsys.readouterr().err
    assert tuned.read(tmp_path / "absent.json") == {}
