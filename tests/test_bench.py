"""`shardmoe bench` machinery: FLOP counts, saved-bytes measurement, interleaved timing
and the CLI on tiny shapes. No assertion here depends on how fast anything runs."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shardmoe import bench


def _has_transformers() -> bool:
    return bench._transformers_available()


@pytest.fixture(autouse=True)
def one_thread():
    """Nothing here is timed against a bar; one thread keeps the tests quick on a busy machine
    (two OpenMP threads wait on each other whenever a core is taken by another process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- FLOPs --------------------------------------------------------------------------------
def test_flop_formulas_by_hand():
    s = bench.Shape(tokens=4, hidden=3, ffn=5, experts=2, top_k=2)
    # M = S*k = 8 rows; forward 2*8*3*10 (gate/up) + 2*8*5*3 (down) = 480 + 240; x3 for fwd+bwd
    assert bench.expert_flops(s) == 3 * (480 + 240) == 2160 == 18 * 8 * 3 * 5
    # logits 2*S*H*E = 48, x3
    assert bench.router_flops(s) == 144
    assert bench.total_flops(s) == 2304


@pytest.mark.parametrize("shape", [bench.Shape(*bench.SHAPES["e8"]), bench.Shape(*bench.SHAPES["e64"]),
                                   bench.Shape(24, 16, 8, 4, 3)])
def test_dense_anchor_does_the_counted_flops(shape):
    small = bench.Shape(min(shape.tokens, 64), shape.hidden, shape.ffn, shape.experts, shape.top_k)
    c = bench._dense_candidate(small, torch.float32, "cpu", preallocated=True, name="dense")
    assert c.flops == bench.total_flops(small)
    c.step()


# --- saved bytes --------------------------------------------------------------------------
def test_saved_bytes_of_a_linear_by_hand():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    sb, y = bench.measure_saved_bytes(lambda: lin(x), lin.parameters(), (x,))
    # addmm keeps x (3*8 fp32 = 96 B) for the weight gradient; the weight is a parameter
    assert (sb.total, sb.input, sb.without_input) == (96, 96, 0)
    y.sum().backward()


def test_saved_bytes_counts_activations_and_dedupes_storages():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)

    def forward():
        z = lin(x)              # saves x (96 B)
        a = F.silu(z)           # saves z: 3*4 fp32 = 48 B
        return a * a[:, :2].repeat(1, 2)  # saves a (48 B) and a's repeat (48 B)

    sb, y = bench.measure_saved_bytes(forward, lin.parameters(), (x,))
    assert sb.input == 96
    assert sb.total == 96 + 48 + 48 + 48
    y.sum().backward()

    # the same storage saved through several views is counted once, and in full
    x2 = torch.randn(4, 6, requires_grad=True)
    sb2, y2 = bench.measure_saved_bytes(lambda: x2[:, :3] * x2[:, 3:], (), (x2,))
    assert (sb2.tensors, sb2.storages) == (2, 1)
    assert sb2.input == 4 * 6 * 4
    y2.sum().backward()


def test_saved_bytes_excludes_parameters_and_bf16_sizes():
    w = torch.nn.Parameter(torch.randn(5, 7, dtype=torch.bfloat16))
    x = torch.randn(2, 5, dtype=torch.bfloat16, requires_grad=True)
    sb, y = bench.measure_saved_bytes(lambda: x @ w, [w], (x,))
    assert sb.total == 2 * 5 * 2  # x in bf16; w (saved for dx) not counted
    y.float().sum().backward()


# --- timing machinery ---------------------------------------------------------------------
def test_time_interleaved_rotates_and_skips_warmup():
    order = []
    cands = {n: bench.Candidate(n, (lambda n=n: order.append(n)), lambda: None) for n in "abc"}
    times = bench.time_interleaved(cands, warmup=2, repeats=3, device="cpu")
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    rounds = [order[i:i + 3] for i in range(0, len(order), 3)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc"), list("bca")]


def test_time_interleaved_budget_keeps_at_least_one_repeat():
    import time

    cands = {"fast": bench.Candidate("fast", lambda: None, lambda: None),
             "slow": bench.Candidate("slow", lambda: time.sleep(0.02), lambda: None)}
    times = bench.time_interleaved(cands, warmup=1, repeats=5, device="cpu", budget_s=1e-6)
    assert len(times["slow"]) == 1 and len(times["fast"]) >= 1


# --- whole cases --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_run_case_has_every_anchor(dtype):
    s = bench.Shape(tokens=64, hidden=32, ffn=64, experts=4, top_k=2)
    r = bench.run_case("tiny", s, dtype, "cpu", warmup=1, repeats=1)
    expected = list(bench.CANDIDATES) if _has_transformers() else [n for n in bench.CANDIDATES if n != "transformers"]
    assert [row.candidate for row in r.rows] == expected
    assert r.flops == bench.total_flops(s)
    text = bench.format_case(r)
    for name in expected:
        assert name in text
    rows = {row.candidate: row for row in r.rows}
    assert rows["dense"].fraction_of_dense == pytest.approx(1.0)
    for name in ("loop", "shardmoe"):
        assert rows[name].saved_bytes > 0 and rows[name].saved_input_bytes == s.tokens * s.hidden * (4 if dtype == "fp32" else 2)
    if _has_transformers():
        assert rows["transformers"].speedup_vs_transformers == pytest.approx(1.0)
        # same weights and input: outputs and gradients agree with transformers
        # (bf16: shardmoe computes gate logits in fp32, so a near-tie may route differently)
        tol = 1e-5 if dtype == "fp32" else 0.3
        assert rows["loop"].rel_err_vs_transformers < (1e-5 if dtype == "fp32" else 5e-2)
        assert rows["shardmoe"].rel_err_vs_transformers < tol
        assert set(r.targets()) == {"speedup vs transformers", "fraction of dense", "saved bytes vs transformers"}


def test_loop_baseline_matches_a_dense_per_token_oracle():
    torch.manual_seed(0)
    S, H, F_, E, k = 10, 8, 6, 3, 2
    x = torch.randn(S, H, dtype=torch.float64)
    wg, wgu, wd = torch.randn(H, E, dtype=torch.float64), torch.randn(E, 2 * F_, H, dtype=torch.float64), \
        torch.randn(E, H, F_, dtype=torch.float64)
    out = bench.loop_moe(x, wg, wgu, wd, k)
    p = torch.softmax(x @ wg, -1)
    for t in range(S):
        top = torch.topk(p[t], k)
        w = top.values / top.values.sum()
        ref = sum(wj * (wd[e] @ (F.silu(wgu[e, :F_] @ x[t]) * (wgu[e, F_:] @ x[t])))
                  for wj, e in zip(w, top.indices.tolist()))
        torch.testing.assert_close(out[t], ref)


def test_cli_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = bench.main(["--quick", "--tokens", "32", "--shapes", "e8", "--dtype", "fp32", "--repeats", "1",
                       "--candidates", "loop", "dense", "shardmoe", "--threads", "1", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "[e8 fp32]" in out and "targets (shardmoe)" in out
    data = json.loads(path.read_text())
    (case,) = data["cases"]
    assert case["shape"]["tokens"] == 32 and [r["candidate"] for r in case["rows"]] == ["loop", "dense", "shardmoe"]
    assert data["environment"]["threads"] >= 1


def test_cli_shape_overrides(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    if "--hidden" not in parser._option_string_actions:
        pytest.skip("the distributed options (--hidden, ...) are not available in this build")
    code = bench.main(["--shapes", "e64", "--tokens", "16", "--hidden", "32", "--ffn", "16", "--experts", "4",
                       "--top-k", "1", "--dtype", "fp32", "--repeats", "1", "--warmup", "1", "--threads", "1",
                       "--candidates", "loop", "dense"])
    assert code == 0
    assert "S=16 H=32 F=16 E=4 k=1" in capsys.readouterr().out


def test_cli_rejects_cuda_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert bench.main(["--device", "cuda"]) == 2


def test_run_case_without_transformers(monkeypatch):
    monkeypatch.setattr(bench, "_transformers_available", lambda: False)
    s = bench.Shape(tokens=32, hidden=16, ffn=32, experts=4, top_k=2)
    r = bench.run_case("tiny", s, "fp32", "cpu", warmup=1, repeats=1)
    assert [row.candidate for row in r.rows] == ["loop", "dense", "dense+alloc", "shardmoe"]
    assert any("transformers" in note for note in r.notes)
    assert all(row.speedup_vs_transformers is None for row in r.rows)
    assert r.targets()["speedup vs transformers"] == (None, bench.TARGET_SPEEDUP_VS_TRANSFORMERS, None)


def test_fresh_routing_feeds_a_new_input_each_step():
    s = bench.Shape(tokens=32, hidden=16, ffn=32, experts=4, top_k=2)
    cands, inputs = bench._build_candidates(s, torch.float32, "cpu", ["loop"], fresh_inputs=2)
    loop = cands["loop"]
    outs = []
    for _ in range(4):
        loop.reset()
        loop.step()
        outs.append(loop.params[0].grad.clone())   # the gate gradient depends on the input
    assert not torch.equal(outs[0], outs[1])        # inputs 1 and 2 differ
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])  # and cycle
    r = bench.run_case("tiny", s, "fp32", "cpu", warmup=1, repeats=2, names=("loop", "dense"), routing="fresh")
    assert r.routing == "fresh" and "fresh routing" in bench.format_case(r)


def test_mesh_runs_are_handed_to_the_distributed_bench(monkeypatch):
    dist_bench = pytest.importorskip("shardmoe.parallel.bench")
    seen = []
    monkeypatch.setattr(dist_bench, "run_distributed", lambda args: seen.append(args.mesh) or 0)
    assert bench.main(["--mesh", "e=1", "--quick"]) == 0
    assert seen == ["e=1"]
