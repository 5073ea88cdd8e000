"""A run's resolved settings, kept in its directory: DIR/config.json.

`shardmoe train` writes the TrainConfig it resolved (preset, config file and flags; paths made
absolute) to DIR/config.json before the first step, in the form a config file takes. `--resume`
starts from it, so `shardmoe train --out DIR --resume` alone continues the run as it was set up,
its `steps` included. What is given again on the command line must agree with it: `--steps` may
move the run's end (the learning-rate schedule follows; the command says so and config.json
records the new length), and any other setting that differs is refused by name, a config file
given again being compared setting by setting. A directory without config.json (a run of
train() from Python) resumes with the settings stored in its newest checkpoint.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from shardmoe.train import sharded_checkpoint
from shardmoe.train.checkpoint import latest_checkpoint, read_metadata, setting_differences
from shardmoe.train.config import LAYOUT_SETTINGS, TrainConfig, with_current_names

SETTINGS_FILE = "config.json"


def settings_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / SETTINGS_FILE


def write_settings(out_dir: str | Path, config: TrainConfig) -> None:
    """DIR/config.json := config (a temporary file, then a rename)."""
    path = settings_path(out_dir)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config.to_dict(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def stored_settings(out_dir: str | Path, option: str = "--resume") -> TrainConfig:
    """The settings of the run in DIR: config.json, else its newest checkpoint's; ValueError naming
    `option` when DIR holds neither or they do not read."""
    path, source = settings_path(out_dir), None
    try:
        if path.is_file():
            source, values = path, json.loads(path.read_text(encoding="utf-8"))
        else:
            checkpoint = latest_checkpoint(out_dir)
            if not checkpoint.exists():
                raise ValueError(f"{out_dir} holds no run (no {SETTINGS_FILE}, no checkpoint)")
            source = checkpoint
            if checkpoint.is_dir():
                values = sharded_checkpoint.read_metadata(checkpoint)["config"]
            else:
                values = json.loads(read_metadata(checkpoint)["config"])
        return TrainConfig.from_dict(with_current_names(values))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{option}: {source}: {err}" if source else f"{option}: {err}") from None


def resume_settings(stored: TrainConfig, given: dict, out_dir: str | Path) -> tuple[TrainConfig, list[str]]:
    """The settings a resume of DIR runs with: `stored`, with `steps` and the layout settings
    (LAYOUT_SETTINGS) from `given` (the settings given again, by name; "model" a table of the model
    settings given) and a line that says so when it moves the end. ValueError naming every other
    setting of `given` that differs from `stored`; a setting `given` does not name is not compared."""
    have = stored.to_dict()
    layout = {key: given[key] for key in LAYOUT_SETTINGS if key in given}
    stored = stored.replace(**layout) if layout else stored
    wanted = json.loads(json.dumps({key: value for key, value in given.items()
                                    if key != "steps" and key not in LAYOUT_SETTINGS}))
    differences = setting_differences(_the_same_keys(have, wanted), wanted)
    if differences:
        raise ValueError(f"--resume: the run in {out_dir} was set up with other settings ("
                         + "; ".join(d.replace(": saved ", ": the run has ").replace(", now ", ", given ")
                                     for d in differences)
                         + f"); a resumed run keeps its settings ({settings_path(out_dir)}): leave those out, "
                           "or start a new run")
    steps = given.get("steps", stored.steps)
    if steps == stored.steps:
        return stored, []
    verb = "extends" if steps > stored.steps else "shortens"
    return stored.replace(steps=steps), [f"--steps {steps} {verb} the run from {stored.steps} to {steps} steps "
                                         "(the learning-rate schedule follows the new length)"]


def _the_same_keys(values: dict, like: dict) -> dict:
    """values restricted to the keys of `like`, table by table."""
    return {key: _the_same_keys(values[key], sub) if isinstance(sub, dict) and isinstance(values.get(key), dict)
            else values.get(key) for key, sub in like.items()}
