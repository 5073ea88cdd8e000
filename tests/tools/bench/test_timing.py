"""Interleaved timing: rotation, warm-up rounds, the budget. No assertion depends on how fast anything runs."""
from __future__ import annotations

from shardmoe.tools.bench.candidates import Candidate
from shardmoe.tools.bench.timing import time_interleaved


def test_time_interleaved_rotates_and_skips_warmup():
    order = []
    cands = {n: Candidate(n, (lambda n=n: order.append(n)), lambda: None) for n in "abc"}
    times = time_interleaved(cands, warmup=2, repeats=3, device="cpu")
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    rounds = [order[i:i + 3] for i in range(0, len(order), 3)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc"), list("bca")]


def test_time_interleaved_budget_keeps_at_least_one_repeat():
    import time

    cands = {"fast": Candidate("fast", lambda: None, lambda: None),
             "slow": Candidate("slow", lambda: time.sleep(0.02), lambda: None)}
    times = time_interleaved(cands, warmup=1, repeats=5, device="cpu", budget_s=1e-6)
    assert len(times["slow"]) == 1 and len(times["fast"]) >= 1
