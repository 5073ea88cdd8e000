"""Whole (shape, dtype) cases on tiny shapes: every anchor, fresh routing."""
from __future__ import annotations

import math

import pytest
import torch

from shardmoe.tools.bench.candidates import CANDIDATES, build_candidates
from shardmoe.tools.bench.case import TARGETS, run_case
from shardmoe.tools.bench.flops import Shape, total_flops
from shardmoe.tools.bench.report import format_case


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_run_case_has_every_anchor(dtype):
    s = Shape(tokens=64, hidden=32, ffn=64, experts=4, top_k=2)
    r = run_case("tiny", s, dtype, "cpu", warmup=1, repeats=1)
    expected = list(CANDIDATES)
    assert [row.candidate for row in r.rows] == expected
    assert r.flops == total_flops(s)
    text = format_case(r)
    for name in expected:
        assert name in text
    rows = {row.candidate: row for row in r.rows}
    assert rows["dense"].fraction_of_dense == pytest.approx(1.0)
    for name in ("loop", "shardmoe"):
        assert rows[name].saved_bytes > 0 and rows[name].saved_input_bytes == s.tokens * s.hidden * (4 if dtype == "fp32" else 2)
    assert rows["transformers"].speedup_vs_transformers == pytest.approx(1.0)
    # same weights and input: outputs and gradients agree with transformers
    # (bf16: shardmoe computes gate logits in fp32, so a near-tie may route differently)
    tol = 1e-5 if dtype == "fp32" else 0.3
    assert rows["loop"].rel_err_vs_transformers < (1e-5 if dtype == "fp32" else 5e-2)
    assert rows["shardmoe"].rel_err_vs_transformers < tol
    assert set(r.targets()) == {"speedup vs transformers", "fraction of dense", "saved bytes vs transformers",
                                "saved + workspace vs transformers (one layer)"}
    # the pool counted: what the workspace holds plus the saved bytes outside it (these tiny buffers
    # stay under the pool's threshold, so nothing is pooled and the two figures agree)
    assert rows["shardmoe"].footprint_vs_transformers == pytest.approx(rows["shardmoe"].saved_vs_transformers)


def test_run_case_without_the_transformers_anchor_has_no_speedup_against_it():
    s = Shape(tokens=32, hidden=16, ffn=32, experts=4, top_k=2)
    r = run_case("tiny", s, "fp32", "cpu", warmup=1, repeats=1, names=("loop", "dense", "shardmoe"))
    assert [row.candidate for row in r.rows] == ["loop", "dense", "shardmoe"]
    assert all(row.speedup_vs_transformers is None for row in r.rows)
    assert r.targets()["speedup vs transformers"] == (None, TARGETS["fp32"][0], None)


def test_fresh_routing_feeds_a_new_input_each_step():
    s = Shape(tokens=32, hidden=16, ffn=32, experts=4, top_k=2)
    cands, inputs = build_candidates(s, torch.float32, "cpu", ["loop"], fresh_inputs=2)
    loop = cands["loop"]
    outs = []
    for _ in range(4):
        loop.reset()
        loop.step()
        outs.append(loop.params[0].grad.clone())   # the gate gradient depends on the input
    assert not torch.equal(outs[0], outs[1])        # inputs 1 and 2 differ
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])  # and cycle
    r = run_case("tiny", s, "fp32", "cpu", warmup=1, repeats=2, names=("loop", "dense"), routing="fresh")
    assert r.routing == "fresh" and "fresh routing" in format_case(r)


def test_the_pool_counts_against_the_saved_bytes_once():
    """Row buffers of this shape are pooled (>= 4 MiB): the footprint holds the workspace and the saved
    bytes outside it; the saved h lives in a pool block and is not counted twice."""
    s = Shape(tokens=2048, hidden=64, ffn=256, experts=4, top_k=2)
    r = run_case("pooled", s, "fp32", "cpu", warmup=1, repeats=1, names=("transformers", "shardmoe"))
    rows = {row.candidate: row for row in r.rows}
    tf_saved, moe = rows["transformers"].saved_bytes, rows["shardmoe"]
    held = moe.footprint_vs_transformers * tf_saved
    workspace = moe.workspace_bytes_per_token * s.tokens
    assert workspace > 0 and workspace < held < workspace + moe.saved_bytes
    assert r.targets()["saved + workspace vs transformers (one layer)"][0] == moe.footprint_vs_transformers


def test_a_non_finite_disagreement_is_infinite_not_zero():
    """max(worst, nan) keeps worst: a NaN output read as agreement (0.0) before."""
    from shardmoe.tools.bench.case import relative_error

    ones = torch.ones(3)
    assert relative_error({"y": ones}, {"y": ones}) == 0.0
    assert relative_error({"y": torch.tensor([1.0, float("nan"), 1.0]), "g": ones}, {"y": ones, "g": ones}) == math.inf
