"""shardmoe.kernels.tuning and .tuned: every autotuned kernel prunes through the tuned table and the
autotune setting (the table's collecting, writing and merging: tests/tools/test_tuned.py)."""
import importlib
import pkgutil
import re

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
    candidates = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n in (64, 256) for w, s in ((4, 3), (8, 4))]
    prune = tuning.Prune("k", ["O", "ACT"])
    args = {"a_ptr": torch.empty(2, dtype=torch.bfloat16), "O": 512, "stride": 7}
    key = tuning.tuning_key(["O", "ACT"], {**args, "ACT": "silu"})
    assert key == (512, "silu", "torch.bfloat16")
    monkeypatch.setattr(tuned, "TABLE", {H100: {"k": {"512|silu|torch.bfloat16": {
        "kwargs": {"BLOCK_N": 256}, "num_warps": 8, "num_stages": 4}}}})
    monkeypatch.setattr(tuning, "current_device_name", lambda: H100)
    [chosen] = prune(candidates, args, ACT="silu")
    assert chosen is candidates[3]
    assert prune(candidates, {**args, "O": 1024}, ACT="silu") == candidates  # another shape: tune
    with settings.override(autotune=False):
        assert prune(candidates, {**args, "O": 1024}, ACT="silu") == candidates[:1]
    monkeypatch.setattr(tuning, "current_device_name", lambda: "another GPU")
    assert prune(candidates, args, ACT="silu") == candidates
    # a table left from other candidates (a narrower tile than any buffer is sized for) is refused
    monkeypatch.setattr(tuning, "current_device_name", lambda: H100)
    with pytest.raises(ValueError, match=re.escape(
            "tuned_configs.json: expected k's tuned config on 'NVIDIA H100 80GB HBM3' at key 512|silu|torch.bfloat16 "
            "to be one of its candidates [({'BLOCK_N': 64}, 4, 3), ({'BLOCK_N': 64}, 8, 4), ({'BLOCK_N': 256}, 4, 3), "
            "({'BLOCK_N': 256}, 8, 3)], got ({'BLOCK_N': 256}, 8, 4)")):
        prune(candidates[:3] + [triton.Config({"BLOCK_N": 256}, num_warps=8, num_stages=3)], args, ACT="silu")
