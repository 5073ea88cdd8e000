"""The tuned kernel configs of a lease: what its autotuners chose, written out, and merged into the
package's table (shardmoe/kernels/tuned.py, which the kernels read at import).

  python -m shardmoe.tools.gpu_check.tuned --merge DIR/tuned_configs.json [...] [--into PATH]

merges files a lease wrote (python -m shardmoe.tools.gpu_check --only lease: runner.write_tuned)
into shardmoe/kernels/tuned_configs.json; later files win per device, kernel and key.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardmoe.kernels.tuned import DATA, FORMAT, key_string, read


def config_entry(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def collect() -> dict:
    """{kernel: {key: config}} of every key the autotuned kernels chose a config for in this process."""
    from shardmoe.kernels.tuning import AUTOTUNED

    return {name: {key_string(key): config_entry(config) for key, config in tuner.cache.items()}
            for name, tuner in AUTOTUNED.items() if tuner.cache}


def write(path: Path, device: str, chosen: dict) -> None:
    """A tuned-configs file holding `chosen` ({kernel: {key: config}}) for `device`."""
    Path(path).write_text(json.dumps({"format": FORMAT, "devices": {device: chosen}}, indent=1, sort_keys=True)
                          + "\n")


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
    parser = argparse.ArgumentParser(prog="python -m shardmoe.tools.gpu_check.tuned",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--merge", metavar="TUNED_JSON", nargs="+", required=True,
                        help="tuned_configs.json files a lease wrote (python -m shardmoe.tools.gpu_check --only lease)")
    parser.add_argument("--into", metavar="PATH", default=str(DATA), help=f"the file to merge into (default {DATA})")
    args = parser.parse_args(argv)
    try:
        devices = merge(Path(args.into), [Path(p) for p in args.merge])
    except ValueError as err:
        print(f"python -m shardmoe.tools.gpu_check.tuned: --merge: {err}", file=sys.stderr)
        return 2
    print(f"{args.into}: " + "; ".join(f"{device}: {sum(len(k) for k in kernels.values())} keys"
                                       for device, kernels in devices.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
