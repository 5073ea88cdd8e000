"""Interleaved timing of the candidates (method: docs/benchmarks.md, "Timing").

Absolute times on a shared CPU mean little; what the report gives are ratios between
candidates, so they are timed side by side: round by round, each once, the order rotating.
"""
from __future__ import annotations

import time

from shardmoe.tools.bench.candidates import Candidate


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(cands: dict[str, Candidate], warmup: int, repeats: int, device,
                     budget_s: float | None = None) -> dict[str, list[float]]:
    """Seconds per forward+backward of each candidate.

    Every round runs each candidate once, starting from a different one each round (so
    no candidate always follows the same neighbour); the first `warmup` rounds are not
    recorded. With `budget_s`, a candidate whose last warm-up step took t seconds gets
    max(1, min(repeats, budget_s / (len(cands) * t))) timed rounds, so one slow anchor
    cannot stretch a smoke run; it then sits out the later rounds."""
    names = list(cands)
    times: dict[str, list[float]] = {n: [] for n in names}
    quota = dict.fromkeys(names, repeats)
    last: dict[str, float] = {}
    r = 0
    while any(len(times[n]) < quota[n] for n in names):
        if r == warmup and budget_s is not None and last:
            for n in names:
                quota[n] = max(1, min(repeats, int(budget_s / (len(names) * max(last[n], 1e-9)))))
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            if r >= warmup and len(times[n]) >= quota[n]:
                continue
            c = cands[n]
            c.reset()
            _sync(device)
            t0 = time.perf_counter()
            c.step()
            _sync(device)
            last[n] = time.perf_counter() - t0
            if r >= warmup:
                times[n].append(last[n])
        r += 1
    for c in cands.values():
        c.reset()
    return times
