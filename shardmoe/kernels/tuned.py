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
nothing. A lease writes what its autotuners chose (collect, write), and

    python -m shardmoe.kernels.tuned --merge DIR/tuned_configs.json [...]

merges such files into the package's (later files win per device, kernel and key).
"""
from __future__ import annotations

import argparse
import json
import sys
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


def config_entry(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def collect() -> dict:
    """{kernel: {key: config}} of every key the autotuned kernels chose a config for in this process."""
    from shardmoe.kernels.tuning import AUTOTUNED

    return {name: {key_string(key): config_entry(config) for key, config in tuner.cache.items()}
            for name, tuner in AUTOTUNED.items() if tuner.cache}


def write(path: Path, device: str, chosen: dict) -> None:
    """A tuned-configs file holding `chosen` ({kernel: {key: config}}) for `device`."""
    Path(path).write_text(json.dumps({"format": FORMAT, "devices": {device: chosen}}, indent=1, sort_keys=True) + "\n")


def merge(target: Path, sources: list[Path]) -> dict:
    """The devices of `target` with those of `sources` merged in (later win per key); written to target."""
    devices = read(target)
    for source in sources:
        for device, kernels in read(source).items():
            for kernel, keys in kernels.items():
                devices.setdefault(device, {}).setdefault(kernel, {}).update(keys)
    Path(target).write_text(json.dumps({"format": FORMAT, "devices": devices}, indent=1, sort_keys=True) + "\n")
    return devices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardmoe.kernels.tuned", description=__doc__.splitlines()[0])
    parser.add_argument("--merge", metavar="TUNED_JSON", nargs="+", required=True,
                        help="tuned_configs.json files a lease wrote (python -m shardmoe.tools.gpu_check --only lease)")
    parser.add_argument("--into", metavar="PATH", default=str(DATA), help=f"the file to merge into (default {DATA})")
    args = parser.parse_args(argv)
    try:
        devices = merge(Path(args.into), [Path(p) for p in args.merge])
    except ValueError as err:
        print(f"python -m shardmoe.kernels.tuned: --merge: {err}", file=sys.stderr)
        return 2
    print(f"{args.into}: " + "; ".join(f"{device}: {sum(len(k) for k in kernels.values())} keys"
                                       for device, kernels in devices.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
