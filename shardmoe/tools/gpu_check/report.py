"""The check's report: DIR/report.json (every number) and DIR/report.md (the same, as tables).

report.json:
  {"format": 1,
   "runs":   [{"started", "host", "device", "dry_run", "argv"}, ...]   every run merged into it
   "stages": {name: {"status": "ok" | "failed" | "skipped" | "running",
                     "seconds", "note", "error", "result": {...}, "run": {the run's entry}}}}

Both files are rewritten after every stage and whenever a stage reports progress, so a run cut
short (a lease's time limit) leaves what it had measured; a stage caught mid-way says "running".
A report already in DIR, and the ones given with --merge, are read first: a stage this run
executes replaces theirs, the others stay, so several short runs add up to one report.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

FORMAT = 1
STATUSES = ("ok", "failed", "skipped", "running")


def table(headers: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines; None cells print as '-', floats as given by the caller (pre-formatted)."""
    def cell(v) -> str:
        return "-" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def fmt(value, spec: str) -> str | None:
    """format(value, spec), or None for a missing value (a '-' cell)."""
    return None if value is None else format(value, spec)


def read(path: Path) -> dict:
    """A report.json's content; ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"expected a report.json written by python -m shardmoe.tools.gpu_check, got {str(path)!r} "
                         f"({type(err).__name__}: {err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("stages"), dict):
        raise ValueError(f"expected a report.json of format {FORMAT} with a 'stages' table, got {str(path)!r}")
    return data


class Report:
    """The stages' entries of this run and of the reports merged into it, and their two files."""

    def __init__(self, out: Path, run: dict):
        self.out = Path(out)
        self.run = run
        self.runs: list[dict] = []
        self.stages: dict[str, dict] = {}

    def merge(self, data: dict) -> None:
        """Take the runs and stages of an earlier report (a later merge replaces a stage)."""
        for run in data.get("runs", []):
            if run not in self.runs:
                self.runs.append(run)
        self.stages.update(data["stages"])

    def record(self, name: str, status: str, *, seconds: float | None = None, result: dict | None = None,
               note: str | None = None, error: str | None = None) -> None:
        if status not in STATUSES:
            raise ValueError(f"status: expected one of {', '.join(STATUSES)}, got {status!r}")
        if self.run not in self.runs:
            self.runs.append(self.run)
        self.stages[name] = {"status": status, "seconds": seconds, "note": note, "error": error,
                             "result": result or {}, "run": self.run}

    def result(self, name: str) -> dict | None:
        """The result of stage `name` (this run's or a merged one), None when there is none."""
        entry = self.stages.get(name)
        return None if entry is None else entry["result"]

    def write(self, markdown_for: dict) -> None:
        """Rewrite report.json and report.md (each through a temporary file and a rename, so a
        reader or a kill never sees half a file). markdown_for: stage name -> f(result) -> lines."""
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT, "runs": self.runs, "stages": self.stages}
        _replace(self.out / "report.json", json.dumps(data, indent=1, default=str))
        _replace(self.out / "report.md", "\n".join(self.markdown(markdown_for)) + "\n")

    def markdown(self, markdown_for: dict) -> list[str]:
        lines = ["# shardmoe GPU check", ""]
        lines += table(["started", "host", "device", "dry run", "command"],
                       [[r["started"], r["host"], r["device"], r["dry_run"], " ".join(r["argv"])] for r in self.runs])
        lines += ["", "## Stages", ""]
        order = [n for n in markdown_for if n in self.stages] + [n for n in self.stages if n not in markdown_for]
        lines += table(["stage", "status", "seconds", "started", "note"],
                       [[n, self.stages[n]["status"], fmt(self.stages[n]["seconds"], ".1f"),
                         self.stages[n]["run"]["started"], self.stages[n]["note"]] for n in order])
        for name in order:
            entry = self.stages[name]
            lines += ["", f"## {name}: {entry['status']}", ""]
            if entry["note"]:
                lines += [entry["note"], ""]
            if entry["error"]:
                lines += ["```", entry["error"].rstrip(), "```", ""]
            if entry["result"] and name in markdown_for:
                lines += markdown_for[name](entry["result"])
        return lines


def _replace(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
