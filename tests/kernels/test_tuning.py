"""shardmoe.kernels.tuning and .tuned: every autotuned kernel prunes through the tuned table and the
autotune setting; the table is read, looked up, collected, written and merged."""
import importlib
import json
import pkgutil

import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

import triton  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

import shardmoe.kernels  # noqa: E402
from shardmoe import settings  # noqa: E402
from shardmoe.kernels import tuned, tuning  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"


def test_every_autotuned_kernel_prunes_through_the_table_and_the_setting():
    """A kernel decorated without tuning.autotune would ignore the tuned configs and compile every
    candidate at every check shape (the first GPU run spent about 60 s per parity case that way)."""
    found = {}
    for name in (m.name for m in pkgutil.iter_modules(shardmoe.kernels.__path__)):
        module = importlib.import_module(f"shardmoe.kernels.{name}")
        found.update({attr: obj for attr, obj in vars(module).items() if isinstance(obj, Autotuner)})
    assert {"forward_gemm_kernel", "grad_gemm_kernel", "down_grad_kernel", "weight_grad_kernel"} <= set(found)
    assert found == tuning.AUTOTUNED
    for name, tuner in found.items():
        assert isinstance(tuner.early_config_prune, tuning.Prune) and tuner.early_config_prune.name == name
        assert tuner.early_config_prune.key_names == tuner.keys


def test_prune_takes_the_tuned_config_of_the_device_and_key(monkeypatch):
    candidates = [triton.Config({"BLOCK_N": n}, num_warps=4, num_stages=3) for n in (64, 128)]
    prune = tuning.Prune("k", ["O", "ACT"])
    args = {"a_ptr": torch.empty(2, dtype=torch.bfloat16), "O": 512, "stride": 7}
    key = tuning.tuning_key(["O", "ACT"], {**args, "ACT": "silu"})
    assert key == (512, "silu", "torch.bfloat16")
    monkeypatch.setattr(tuned, "TABLE", {H100: {"k": {"512|silu|torch.bfloat16": {
        "kwargs": {"BLOCK_N": 256}, "num_warps": 8, "num_stages": 4}}}})
    monkeypatch.setattr(tuning, "current_device_name", lambda: H100)
    [chosen] = prune(candidates, args, ACT="silu")
    assert chosen.kwargs == {"BLOCK_N": 256} and (chosen.num_warps, chosen.num_stages) == (8, 4)
    assert prune(candidates, {**args, "O": 1024}, ACT="silu") == candidates  # another shape: tune
    with settings.override(autotune=False):
        assert prune(candidates, {**args, "O": 1024}, ACT="silu") == candidates[:1]
    monkeypatch.setattr(tuning, "current_device_name", lambda: "another GPU")
    assert prune(candidates, args, ACT="silu") == candidates


def test_tuned_configs_are_collected_written_and_merged(tmp_path, monkeypatch, capsys):
    assert tuned.read(tuned.DATA) == tuned.TABLE  # the package's file parses (it may be empty)
    config = triton.Config({"BLOCK_O": 128, "BLOCK_K": 256, "BLOCK_R": 64}, num_warps=8, num_stages=3)
    fake = Autotuner.__new__(Autotuner)
    fake.cache = {(512, 1536, "identity", "torch.bfloat16"): config}
    monkeypatch.setitem(tuning.AUTOTUNED, "weight_grad_kernel", fake)
    chosen = tuned.collect()
    entry = {"kwargs": {"BLOCK_O": 128, "BLOCK_K": 256, "BLOCK_R": 64}, "num_warps": 8, "num_stages": 3}
    assert chosen["weight_grad_kernel"] == {"512|1536|identity|torch.bfloat16": entry}
    first, second, target = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "tuned_configs.json"
    tuned.write(first, H100, chosen)
    tuned.write(second, H100, {"weight_grad_kernel": {"512|1536|identity|torch.bfloat16": {**entry, "num_stages": 4},
                                                      "1|2|relu|torch.bfloat16": entry}})
    assert tuned.main(["--merge", str(first), str(second), "--into", str(target)]) == 0
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
    assert tuned.main(["--merge", str(bad), "--into", str(tmp_path / "t.json")]) == 2
    assert "bad.json: expected a tuned-configs file of format 1" in capsys.readouterr().err
    assert tuned.read(tmp_path / "absent.json") == {}
