"""The simulator's pipeline model on cases small enough to compute by hand (every figure a formula of
the inputs), and `shardmoe simulate --pipeline` on a small layer."""
import argparse
import json

import pytest

from shardmoe.simulate import command
from shardmoe.simulate.pipeline import (PipelineLayout, fastest, layouts, memory_bytes, pipeline_seconds, price,
                                        sweep_layouts)
from shardmoe.simulate.presets import Hardware, ModelShape

HW = Hardware(nvlink_bandwidth=1e10, fabric_bandwidth=1e9, nvlink_latency=1e-6, fabric_latency=1e-5, gpus_per_node=2,
              bytes_per_element=2, memory_bytes=1e9)
SHAPE = ModelShape(hidden_size=64, ffn_size=32, num_experts=4, top_k=2, tokens_per_gpu=16, layers=4, batch_tokens=256)


def test_the_schedules_fill_and_drain_p_minus_1_chunks():
    assert pipeline_seconds(1.0, 1, 1, 8) == (8.0, 0.0)
    assert pipeline_seconds(1.0, 4, 1, 8) == (11.0, 3 / 11)  # GPipe and 1F1B: (m + p - 1) t
    assert pipeline_seconds(0.5, 4, 2, 8) == (9.5, 3 / 19)  # interleaved, chunks of half the layers


def test_layouts_split_the_gpus_and_the_batch():
    found = {(l.p, l.e, l.d): l.microbatches for l in layouts(8, SHAPE)}
    # p * e * d = 8, e | E = 4, p <= 4 layers, m = 256 / (d e 16)
    assert found == {(1, 1, 8): 2, (1, 2, 4): 2, (1, 4, 2): 2, (2, 1, 4): 4, (2, 2, 2): 4, (2, 4, 1): 4,
                     (4, 1, 2): 8, (4, 2, 1): 8}


def test_a_layout_priced_by_hand():
    layout = PipelineLayout(p=2, e=2, d=2, microbatches=4)
    row = price(layout, "1f1b", 2, layer_seconds=1e-3, shape=SHAPE, hw=HW)
    x = 16 * 64 * 2 / 1e9 + 1e-5  # 2 * 2 * 2 = 8 GPUs span 4 nodes of 2: the fabric
    chunk = 2 * 1e-3 + 2 * x  # 2 layers per stage
    gradient = 2 * 2 * 3 * 64 * 32 * 2  # E/e experts x layers x 3HF x b
    allreduce = 2 * (2 - 1) / 2 * gradient / 1e9 + 1e-5  # d = 2 ranks of a 4-rank stage: the fabric
    assert row["transfer_seconds"] == pytest.approx(x) and row["chunk_seconds"] == pytest.approx(chunk)
    assert row["pipeline_seconds"] == pytest.approx(5 * chunk) and row["bubble"] == pytest.approx(1 / 5)
    assert row["allreduce_seconds"] == pytest.approx(allreduce)
    assert row["step_seconds"] == pytest.approx(5 * chunk + allreduce)
    assert row["tokens_per_s"] == pytest.approx(256 / row["step_seconds"])
    activations = 2 * 2 * 16 * 2 * (64 + 2 * (64 + 2 * 32))  # p in flight x layers x tokens x b x (H + k(H + 2F))
    assert row["memory_bytes"] == 2 * 2 * 3 * 64 * 32 * 16 + activations
    gpipe = memory_bytes(layout, "gpipe", SHAPE, HW)  # m = 4 micro-batches in flight
    assert gpipe == 2 * 2 * 3 * 64 * 32 * 16 + 2 * activations
    interleaved = price(layout, "interleaved-1f1b", 2, 1e-3, SHAPE, HW)
    assert interleaved["chunk_seconds"] == pytest.approx(1e-3 + 2 * x) and interleaved["bubble"] == pytest.approx(1 / 9)
    alone = price(PipelineLayout(1, 2, 1, 8), "gpipe", 1, 1e-3, SHAPE, HW)  # no pipeline: no transfer, no bubble
    assert alone["transfer_seconds"] == 0 and alone["bubble"] == 0 and alone["allreduce_seconds"] == 0


def test_the_sweep_orders_by_step_and_keeps_what_the_schedules_can_run():
    layer = {e: {"tile_seconds": 1e-3 / e, "bulk_seconds": 2e-3 / e} for e in (1, 2, 4)}
    rows = sweep_layouts(8, SHAPE, HW, layer)
    assert all(not (r["schedule"] == "1f1b" and r["microbatches"] < r["p"]) for r in rows)
    assert all(not (r["schedule"] == "interleaved-1f1b" and r["p"] == 1) for r in rows)
    assert not any(r["schedule"] == "interleaved-1f1b" and r["p"] == 4 for r in rows)  # 8 chunks of 4 layers
    fits = [r for r in rows if r["fits"]]
    assert [r["step_seconds"] for r in fits] == sorted(r["step_seconds"] for r in fits)
    assert rows[:len(fits)] == fits and fastest(rows) == fits[0]
    assert all(r["bulk_step_seconds"] > r["step_seconds"] for r in rows)
    assert fastest([dict(r, fits=False) for r in rows]) is None


def _parse(*argv):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_command_prices_the_layouts_and_names_the_fastest(tmp_path, capsys):
    small = ["--preset", "mixtral-8x7b", "--gpus", "4", "--set", "tokens_per_gpu=128", "--set", "hidden_size=256",
             "--set", "ffn_size=512", "--set", "batch_tokens=4096", "--set", "layers=4", "--pipeline"]
    args = _parse(*small, "--out", str(tmp_path))
    command.check_arguments(args)
    assert command.run(args) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "simulate.json").read_text())
    rows = report["pipeline"]["4"]
    top = fastest(rows)
    assert {(r["p"], r["e"], r["d"]) for r in rows} == {(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1),
                                                        (4, 1, 1)}
    assert out.splitlines()[-2] == (
        f"fastest at 4 GPUs: p={top['p']}, e={top['e']}, d={top['d']} with {top['schedule']} ({top['microbatches']} "
        f"micro-batches): {top['step_seconds']:.3f} s per step, bubble {100 * top['bubble']:.1f}%, "
        f"{top['tokens_per_s'] / 1e6:.2f} M tokens/s, {top['memory_bytes'] / 1e9:.0f} GB per GPU")
    with pytest.raises(ValueError, match=r"--gpus 4: no pipeline layout \(p \* e \* d = 4, e dividing E = 8, p at most "
                                         r"layers = 4\) splits batch_tokens = 100 into whole micro-batches"):
        command.check_arguments(_parse(*small, "--set", "batch_tokens=100"))
    with pytest.raises(ValueError, match=r"--stages-per-rank: expected a number >= 2, got 1"):
        command.check_arguments(_parse(*small, "--stages-per-rank", "1"))
