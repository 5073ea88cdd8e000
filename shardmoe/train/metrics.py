"""DIR/metrics.jsonl: one JSON row per optimizer step, appended whole or not at all.

A row is written with a single os.write of its full line; if the write fails (a full disk: OSError
ENOSPC) or is short, the file is truncated back to its length before the row, so the file never
ends in a torn line, and the OSError names the file. A row torn by something the process cannot
catch (power loss, SIGKILL mid-write) is an unterminated final line: read_metrics drops it with a
warning naming the file (the checkpoint, not the log, says where a resume continues). Any other
unparsable line is an error that names the file and the line number.

The load columns of a row (load_columns), per MoE layer l and expert j of the step's global batch:

    expert_tokens[l][j]          (token, expert) pairs layer l sent to expert j (after capacity),
                                 summed over every rank's tokens
    load_max_over_mean[l]        max_j expert_tokens[l][j] / mean_j expert_tokens[l][j]
                                 (1 is perfect balance; E / k, its most for dropless top-k, means k
                                 experts took every token)
    worst_load_max_over_mean     max_l load_max_over_mean[l]
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

METRICS_FILE = "metrics.jsonl"


def metrics_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / METRICS_FILE


class MetricsLog:
    """Appends rows to DIR/metrics.jsonl; each append is all or nothing (see the module doc)."""

    def __init__(self, out_dir: str | Path):
        self.path = metrics_path(out_dir)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, row: dict) -> None:
        line = (json.dumps(row) + "\n").encode("utf-8")
        before = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"short write: {written} of {len(line)} bytes")
        except OSError as err:
            os.ftruncate(self._fd, before)  # the partial row goes: the file ends at a whole line
            raise OSError(err.errno, f"cannot append step {row.get('step')} to {self.path}: "
                                     f"{err.strerror or err}; the file keeps its earlier rows") from err

    def close(self) -> None:
        os.close(self._fd)


def load_columns(tokens_per_expert: list[torch.Tensor]) -> dict:
    """The load columns (see the module doc) from each layer's global tokens per expert [E]."""
    counts = [[int(c) for c in layer.tolist()] for layer in tokens_per_expert]
    ratios = [max(c) * len(c) / sum(c) for c in counts]
    return {"expert_tokens": counts, "load_max_over_mean": ratios, "worst_load_max_over_mean": max(ratios)}


def throughput(rows: list[dict]) -> tuple[float, float]:
    """(tokens/s, MFU) of the steps of `rows` together: their tokens and their model FLOPs over
    their whole time, i.e. each row's tokens_per_s and mfu weighted by its seconds (the mean of the
    rows' figures would weigh a slow interval's steps like a fast one's and overstate both)."""
    seconds = sum(r["seconds"] for r in rows)
    return (sum(r["tokens_per_s"] * r["seconds"] for r in rows) / seconds,
            sum(r["mfu"] * r["seconds"] for r in rows) / seconds)


def read_metrics(out_dir: str | Path, up_to: int) -> list[dict]:
    """The rows of DIR/metrics.jsonl with step <= up_to (read_rows)."""
    return read_rows(metrics_path(out_dir), up_to)


def write_metrics(out_dir: str | Path, rows: list[dict]) -> None:
    """Replace DIR/metrics.jsonl with `rows` (write_rows)."""
    write_rows(metrics_path(out_dir), rows)


def read_rows(path: Path, up_to: int) -> list[dict]:
    """The rows of a run's JSONL file (one JSON object per line, each with a "step") with step <=
    up_to ([] when there is no file). An unterminated, unparsable final line (a torn row) is
    dropped with a warning; any other unparsable line raises ValueError naming the file and line."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # the last line, with no newline after it: torn mid-write
                warnings.warn(f"{path}: dropping a torn final row (line {number}, {len(line)} bytes, "
                              "no newline): the run that wrote it was interrupted mid-write", stacklevel=2)
                continue
            raise ValueError(f"{path}: line {number} is not a JSON row ({err})") from None
    return [r for r in rows if r["step"] <= up_to]


def write_rows(path: Path, rows: list[dict]) -> None:
    """Replace a run's JSONL file with `rows` atomically (a temporary file, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
