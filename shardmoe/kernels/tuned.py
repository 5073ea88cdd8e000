"""Tuned kernel configs kept as data: what a GPU lease's autotuning picked, per device and key.

  shardmoe/kernels/tuned_configs.json
    {"format": 1,
     "devices": {device name (torch.cuda.get_device_name): {kernel name: {key: config}}}}
    key     the autotuner's key of a launch (tuning.tuning_key: the kernel's `key` sizes, the GEMM
            row tile BLOCK_M where it is one, the constexpr variant, the dtypes), its parts joined by "|":
            the shape bucket a config holds for
    config  {"kwargs": {tile sizes}, "num_warps": w, "num_stages": s}

The file is read once, at import. A launch whose device and key it holds runs that config without
tuning (tuning.Prune); anything else autotunes as before, so an empty or absent file changes
nothing. What a lease's autotuners chose is written, and such files are merged into the package's,
by shardmoe/tools/gpu_check/tuned.py (python -m shardmoe.tools.gpu_check.tuned --merge ...).
"""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).with_name("tuned_configs.json")
FORMAT = 1


def key_string(key: tuple) -> str:
    return "|".join(str(part) for part in key)


def read(path: Path) -> dict:
    """{device: {kernel: {key: config}}} of a tuned-configs file; {} when it is absent or empty;
    ValueError naming the file when it is not one."""
    path = Path(path)
    if not path.exists() or not path.read_text().strip():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: expected a tuned-configs JSON file, got invalid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("devices"), dict):
        raise ValueError(f"{path}: expected a tuned-configs file of format {FORMAT} with a 'devices' table, "
                         f"got keys {sorted(data) if isinstance(data, dict) else type(data).__name__}")
    return data["devices"]


TABLE = read(DATA)


def lookup(device: str, kernel: str, key: tuple):
    """The triton.Config tuned for `kernel` at `key` on `device`, None when there is none."""
    entry = TABLE.get(device, {}).get(kernel, {}).get(key_string(key))
    if entry is None:
        return None
    import triton

    return triton.Config(dict(entry["kwargs"]), num_warps=entry["num_warps"], num_stages=entry["num_stages"])
