"""TrainConfig: every setting of a training run, with defaults, loaded from JSON or TOML.

A config file holds top-level training settings and a `model` table (TransformerConfig's flat form);
anything left out keeps the value of its architecture preset (`arch`, shardmoe.train.presets),
or else its default:

    arch = "mixtral"
    steps = 300
    lr = 3e-3
    data = "corpus/*.jsonl"      # relative paths are read from the file's folder
    [model]
    d_model = 96

Unknown keys are errors (a typo must not silently train the default). Command-line options
(--arch, --steps, --seed, --backward, --timeout-minutes, --data, --tokenizer) override the file.
docs/training.md ("Configuration") has a table of every setting. model.vocab_size, when no layer
sets it, follows the tokenizer: its ids (BOS included) padded to a multiple of 64.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from shardmoe.arguments import SEED_MAX
from shardmoe.model.residuals import check_backward_mode
from shardmoe.model.transformer import TransformerConfig, check_checkpointing
from shardmoe.moe.config import FLOAT32_MAX, check_bool_fields, is_finite_number
from shardmoe.parallel.pipeline import check_schedule_settings
from shardmoe.train.accumulate import BALANCE_OVER
from shardmoe.train.device import check_device
from shardmoe.train.presets import DEFAULT_ARCH, check_arch, with_preset
from shardmoe.train.tokenizer import (BYTE, VOCAB_MULTIPLE, byte_tokenizer, check_vocab, load_tokenizer,
                                      padded_vocab_size)

DTYPES = ("float32", "float64", "bfloat16")
CHECKPOINT_FORMATS = ("auto", "safetensors", "dcp")
# Settings a resumed run must share with the checkpoint: they fix the weights' shapes and the data
# stream. Optimizer settings and `steps` may change on resume (docs/training.md).
RESUME_IDENTITY = ("arch", "model", "dtype", "seq_len", "batch_size", "seed", "data", "tokenizer", "val_fraction")
# Settings of the layout, not of the run: how a pipelined mesh schedules its stages, where the run
# computes, what the backward recomputes, how often the log is read. Like --mesh, a resume may
# change them (the update is the same whichever of them runs it).
LAYOUT_SETTINGS = ("pipeline_schedule", "stages_per_rank", "device", "activation_checkpointing", "log_every")
# Settings that are paths: a config file's relative ones are read from the file's folder.
PATH_SETTINGS = ("data", "tokenizer", "token_cache")
# Settings under the names checkpoints of earlier versions stored them with.
RENAMED_SETTINGS = {"corpus": "data", "sample_bytes": "sample_tokens"}
INT64_MAX = 2 ** 63 - 1  # step counts, positions and sizes become int64 in numpy and torch
# The process group's timeout: timedelta(minutes=...) in whole milliseconds (below 1 ms it is 0 and
# the store times out at once), counted in int64 nanoseconds by torch's store (about 1.5e8 minutes).
TIMEOUT_MINUTES = (1 / 60_000, 1e8)


@dataclass(frozen=True)
class TrainConfig:
    """Defaults train in about 1.5 minutes of one core (docs/training.md, "Defaults and why": the reasons and the run).

    batch_size is global (rows over all data-parallel ranks); seq_len L tokens per row.
    lr: the peak; linear warm-up over warmup_steps, cosine decay to min_lr_ratio * lr at `steps`.
    max_grad_norm: clip the global gradient norm (over all shards) to this; 0 disables clipping.
    data: None for the embedded KJV text, or a file, a directory or a glob of text, JSONL or Parquet
    files (shardmoe/train/documents.py); tokenizer: "byte" or a local Hugging Face tokenizer
    (shardmoe/train/tokenizer.py); token_cache: the directory of tokenized corpora (None:
    ~/.cache/shardmoe/tokens, shardmoe/train/token_cache.py). eval_batches: held-out batches scored
    at the end (and every eval_every steps if > 0).
    checkpoint_every: also save every so many steps (0: only at the end). checkpoint_format:
    "safetensors" (one file, the whole state gathered), "dcp" (sharded, every rank writing its own
    blocks; the single file is still written at the last step, as the run's export) or "auto"
    (dcp on several ranks, safetensors on one); a resume reads either. health_every: run the
    gradient health report every so many steps and log flagged parameters (0: never).
    dtype: "float32", "float64", or "bfloat16": float32 parameters (the master weights), gradients
    and AdamW moments, every forward under torch.autocast(bfloat16) (param_dtype, autocast_dtype;
    docs/training.md says why this and not bf16 parameters beside fp32 masters).
    grad_accum_steps N: each step's batch runs as N micro-batches of batch_size / N rows, the same
    update as the whole batch; balance_over: the balance losses per "microbatch" (averaged) or
    over the "global" batch (train/accumulate.py).
    pipeline_schedule, stages_per_rank: how a mesh with p > 1 runs its stages (ignored without one):
    "gpipe", "1f1b" (one stage per rank) or "interleaved-1f1b" (stages_per_rank >= 2), torch's
    schedules over the grad_accum_steps micro-batches (shardmoe/parallel/pipeline.py).
    device: where the run computes, "auto" (a GPU when torch sees one), "cpu" or "cuda"
    (shardmoe/train/device.py; under torchrun on GPUs each rank takes GPU LOCAL_RANK and NCCL).
    activation_checkpointing: what the backward recomputes instead of keeping, "none", "moe" (each
    block's MoE layer) or "block" (whole blocks): less memory for about one more forward of what
    it recomputes, the same gradients bit for bit (shardmoe/model/transformer.py).
    log_every: the step's losses, gradient norm and loads stay on the device and are read (one
    host wait) every log_every steps, and at evaluation, sample, health and checkpoint steps and
    the last; metrics.jsonl still gets one row per step, timed by its interval.
    threads: torch intra-op threads per rank (0: torch's default). One, because on a shared CPU
    OpenMP threads spin-wait on each other: a step measured up to 10x slower with two threads here.
    timeout_minutes: how long a rank waits for its peers (process-group start-up and every
    collective) before failing with a message, instead of torch's default 30 minutes.
    sample_tokens: tokens sampled per prompt (0: no samples), every sample_every steps (0: only at
    the last step) and at the last step, at sample_temperature, from prompts of the held-out data.
    model.vocab_size must cover the tokenizer's ids (257 for bytes): an id without an embedding row
    would make the cross-entropy meaningless (it went negative).
    arch: the preset (shardmoe.train.presets) the settings started from; from_dict applies it,
    the constructor only checks the name (the defaults are the "mixtral" preset).
    """

    arch: str = DEFAULT_ARCH
    model: TransformerConfig = field(default_factory=TransformerConfig)
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 6e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    grad_accum_steps: int = 1
    balance_over: str = "microbatch"
    pipeline_schedule: str = "1f1b"
    stages_per_rank: int = 1
    backward: str = "explicit"
    data: str | None = None
    tokenizer: str = BYTE
    token_cache: str | None = None
    val_fraction: float = 0.05
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    checkpoint_format: str = "auto"
    health_every: int = 50
    sample_tokens: int = 160
    sample_every: int = 200
    sample_temperature: float = 0.8
    device: str = "auto"
    activation_checkpointing: str = "none"
    log_every: int = 10
    threads: int = 1
    timeout_minutes: float = 5.0

    def __post_init__(self) -> None:
        check_arch(self.arch)
        check_bool_fields(self)
        if not isinstance(self.model, TransformerConfig):
            raise ValueError(f"model: expected a TransformerConfig, got {type(self.model).__name__}")
        if self.tokenizer == BYTE:  # another tokenizer is read (and checked) with the data
            check_vocab(self.model.vocab_size, byte_tokenizer())
        for name in ("steps", "batch_size", "seq_len", "grad_accum_steps", "log_every"):
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every", "health_every",
                     "sample_tokens", "sample_every", "threads"):
            _check_int(name, getattr(self, name), 0)
        _check_int("seed", self.seed, 0, SEED_MAX)
        if self.threads > (os.cpu_count() or 1):  # torch.set_num_threads takes any int; 100000 segfaulted
            raise ValueError(f"threads: expected an int in 0..{os.cpu_count() or 1} (os.cpu_count()), "
                             f"got {self.threads}")
        # the update of a float32 parameter takes lr as a float32 scalar
        _check_number("lr", self.lr, low=0.0, high=FLOAT32_MAX, low_open=True)
        _check_number("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _check_number("weight_decay", self.weight_decay, low=0.0)
        _check_number("beta1", self.beta1, low=0.0, high=1.0, high_open=True)
        _check_number("beta2", self.beta2, low=0.0, high=1.0, high_open=True)
        _check_number("adam_eps", self.adam_eps, low=0.0, low_open=True)
        _check_number("max_grad_norm", self.max_grad_norm, low=0.0)
        _check_number("val_fraction", self.val_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        _check_number("sample_temperature", self.sample_temperature, low=0.0, low_open=True)
        low, high = TIMEOUT_MINUTES
        if isinstance(self.timeout_minutes, bool) or not isinstance(self.timeout_minutes, (int, float)) \
                or not low <= self.timeout_minutes <= high:
            raise ValueError(f"timeout_minutes: expected minutes from 1 ms ({low:.3g}) to {high:g} (the most the "
                             f"process group can count), got {self.timeout_minutes!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format: expected one of {', '.join(CHECKPOINT_FORMATS)}, "
                             f"got {self.checkpoint_format!r}")
        if self.balance_over not in BALANCE_OVER:
            raise ValueError(f"balance_over: expected one of {', '.join(BALANCE_OVER)}, got {self.balance_over!r}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"grad_accum_steps: expected a divisor of batch_size={self.batch_size}, "
                             f"got {self.grad_accum_steps}")
        check_backward_mode(self.backward)
        check_device(self.device)
        check_checkpointing(self.activation_checkpointing)
        check_schedule_settings(self.pipeline_schedule, self.stages_per_rank)
        for name in ("data", "token_cache"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}: expected a path or null, got {value!r}")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"tokenizer: expected {BYTE!r} or a path, got {self.tokenizer!r}")

    @property
    def param_dtype(self):
        """The parameters' (and gradients', optimizer moments', checkpoints') torch dtype."""
        import torch

        return torch.float64 if self.dtype == "float64" else torch.float32

    def sharded_checkpoints(self, world_size: int) -> bool:
        """Whether a run on world_size ranks writes sharded (dcp) checkpoints."""
        return self.checkpoint_format == "dcp" or (self.checkpoint_format == "auto" and world_size > 1)

    @property
    def autocast_dtype(self):
        """The dtype forwards run under torch.autocast in, or None (no autocast)."""
        import torch

        return torch.bfloat16 if self.dtype == "bfloat16" else None

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["model"] = self.model.to_dict()
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """The settings in `values` over those of the preset `values["arch"]` (default "mixtral");
        model.vocab_size, unless given, follows the tokenizer (which is read here)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        values = with_preset(values)
        model = values.get("model", {})
        if not isinstance(model, dict):
            raise ValueError(f"model: expected a table of model settings, got {model!r}")
        if "vocab_size" not in model:
            ids = load_tokenizer(values.get("tokenizer", BYTE)).vocab_size
            model = {**model, "vocab_size": padded_vocab_size(VOCAB_MULTIPLE, ids)}
        values["model"] = TransformerConfig.from_dict(model)
        return cls(**values)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def resume_identity(self) -> dict:
        """The settings a checkpoint must have been written with to be resumed by this config."""
        values = self.to_dict()
        return {key: values[key] for key in RESUME_IDENTITY}


def with_current_names(values: dict) -> dict:
    """`values` (stored settings) with every RENAMED_SETTINGS key under its current name."""
    return {RENAMED_SETTINGS.get(key, key): value for key, value in values.items()}


def read_config_file(path: str | Path) -> dict:
    """The settings of a .json or .toml file as a dict, its relative paths (PATH_SETTINGS) made
    absolute from the file's folder; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config: no such file {str(path)!r}")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".toml":
            values = tomllib.loads(text)
        elif path.suffix == ".json":
            values = json.loads(text)
        else:
            raise ValueError(f"expected a .json or .toml file, got suffix {path.suffix!r}")
    except (ValueError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"--config {path}: {err}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a table of settings at the top level")
    for name in PATH_SETTINGS:
        value = values.get(name)
        if isinstance(value, str) and value and not (name == "tokenizer" and value == BYTE):
            values[name] = os.path.join(path.parent.resolve(), os.path.expanduser(value))
    return values


def load_config(path: str | Path, arch: str | None = None) -> TrainConfig:
    """TrainConfig from a .json or .toml file; errors name the file and the setting.
    `arch` (the --arch flag) replaces the file's own `arch`."""
    values = read_config_file(path)
    try:
        return TrainConfig.from_dict(values if arch is None else {**values, "arch": arch})
    except (ValueError, TypeError) as err:
        raise ValueError(f"--config {path}: {err}") from None


def _check_int(name: str, value, low: int, high: int = INT64_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if value > high:
        raise ValueError(f"{name}: expected an int in {low}..{high}, got {value!r}")


def _check_number(name: str, value, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False) -> None:
    ok = is_finite_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open or high is None else "]"
        span = f"{left}{low}, {high if high is not None else 'inf'}{right}"
        raise ValueError(f"{name}: expected a finite number in {span}, got {value!r}")
