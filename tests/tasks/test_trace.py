"""Traces: every dependency shows in the timing, the Chrome JSON is well formed, the PNG is a
PNG, `shardmoe trace` writes both; a schedule that loses a task is reported."""
import json
from collections import defaultdict

import pytest
import torch

import shardmoe
from shardmoe import cli
from shardmoe.tasks import ScheduleError, run_backward, run_forward
from shardmoe.tasks.emitters import Emitters

SCHEDULE = dict(peers=4, ranks_per_node=2, block_m=2, block_n=4)


def _layer_and_inputs(top_k=2, expert="mlp"):
    torch.manual_seed(2)
    layer = shardmoe.MoE(8, 6, 4, top_k, expert=expert, capacity_factor=0.75, aux_loss_coef=0.1, dtype=torch.float64)
    x = torch.randn(12, 8, dtype=torch.float64)
    return layer, x, torch.randn(12, 8, dtype=torch.float64)


def _spans(events, kind):
    """(expert, syncIdx) -> (earliest start, latest end) of the row tile's tasks of one type."""
    out = {}
    for e in events:
        if e.type == kind:
            lo, hi = out.get((e.expert, e.sync_idx), (float("inf"), 0.0))
            out[(e.expert, e.sync_idx)] = (min(lo, e.start), max(hi, e.end))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_backward_trace_respects_every_dependency(seed):
    layer, x, grad_out = _layer_and_inputs(top_k=3)
    bwd = run_backward(layer, x, grad_out, seed=seed, processors=1 + seed % 3, **SCHEDULE)
    events = bwd.trace.events
    combine = defaultdict(float)
    for kind in ("gradCombine", "gradGateCombine"):
        for key, (_, end) in _spans(events, kind).items():
            combine[key] = max(combine[key], end)
    post, pre, gather = (_spans(events, k) for k in ("gradPostGEMM", "gradPreGEMM", "gradInputCombine"))
    assert post.keys() == pre.keys() == gather.keys() == combine.keys()
    for key in post:
        assert combine[key] <= post[key][0] and post[key][1] <= pre[key][0] and pre[key][1] <= gather[key][0]
    plan = bwd.forward.plan
    tile_of = {(t.expert, t.sync_idx): t for t in plan.row_tiles}
    dots_done = defaultdict(float)
    for key, (_, end) in _spans(events, "gradGateCombine").items():
        for token in tile_of[key].tokens.tolist():
            dots_done[token] = max(dots_done[token], end)
    for e in events:
        if e.type == "gradGateGEMM":
            tokens = plan.token_tile_at[(e.device, e.sync_idx)].tokens.tolist()
            assert all(dots_done[t] <= e.start for t in tokens)
    # a processor runs one task at a time
    by_processor = defaultdict(list)
    for e in events:
        by_processor[(e.device, e.processor)].append((e.start, e.end))
    for spans in by_processor.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_chrome_json_and_png(tmp_path):
    layer, x, grad_out = _layer_and_inputs()
    bwd = run_backward(layer, x, grad_out, processors=3, **SCHEDULE)
    data = json.loads(bwd.trace.save_json(tmp_path / "b.json").read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(bwd.counts.values())
    for e in complete:
        assert isinstance(e["name"], str) and e["name"] in bwd.counts
        assert isinstance(e["pid"], int) and 0 <= e["pid"] < 4 and isinstance(e["tid"], int) and 0 <= e["tid"] < 3
        assert isinstance(e["ts"], float) and e["ts"] >= 0 and e["dur"] > 0
        assert {"syncIdx", "tileIdx", "expert", "peer", "uid"} <= e["args"].keys()
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(names) == 4 * 3
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        "device 0 (node 0)", "device 1 (node 0)", "device 2 (node 1)", "device 3 (node 1)"}
    signals = [e for e in events if e["ph"] == "i"]
    assert {e["name"] for e in signals} == {"flag", "heap signal", "gate signal"}
    png = bwd.trace.save_png(tmp_path / "b.png")
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 1000 and height > 300


def test_cli_trace_writes_json_png_and_counts(tmp_path, capsys):
    args = ["trace", "--out", str(tmp_path), "--tokens", "12", "--hidden", "8", "--ffn", "6", "--experts", "4",
            "--top-k", "2", "--expert", "glu", "--peers", "2", "--ranks-per-node", "1", "--processors", "2",
            "--block-m", "3", "--block-n", "4", "--aux-loss-coef", "0.1"]
    assert cli.main(args) == 0
    for name in ("forward.json", "backward.json", "forward.png", "backward.png", "counts.json"):
        assert (tmp_path / name).stat().st_size > 0
    summary = json.loads((tmp_path / "counts.json").read_text())
    assert summary["backward"]["gradGateGEMM"] == summary["token_tiles"] * summary["tNx"]
    assert max(summary["max_relative_error"].values()) <= 1e-12
    assert "largest relative difference from the MoE layer" in capsys.readouterr().out


def test_trace_help_describes_every_option_with_its_default():
    """Its layer options had neither a description nor a default in --help."""
    import argparse

    from shardmoe.tasks import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    for action in parser._actions:
        if action.dest in ("help", "out"):
            continue
        assert action.help and len(action.help) > 20, action.dest
        assert "default" in action.help, action.dest
        if action.default not in (None, False):
            assert "%(default)s" in action.help, action.dest
    assert "docs/tasks.md" in parser.epilog


def test_a_lost_task_leaves_its_counter_short_and_is_reported(monkeypatch):
    """An emitter that writes one gradPreGEMM too few: the row tile never signals its token device,
    and the run ends naming the counter that stayed below its threshold."""
    layer, x, grad_out = _layer_and_inputs()
    fwd = run_forward(layer, x, **SCHEDULE)

    original = Emitters.notify_grad_pre_gemm

    def short_notify(self, tile):
        self.plan.tnx -= 1
        try:
            original(self, tile)
        finally:
            self.plan.tnx += 1

    monkeypatch.setattr(Emitters, "notify_grad_pre_gemm", short_notify)
    with pytest.raises(ScheduleError, match=r"counters short of their thresholds: tQS\[\d+\] \(gradPostGEMM \+ "
                                            r"gradPreGEMM of syncIdx \d+\)=\d+/\d+ on device"):
        run_backward(layer, x, grad_out, forward=fwd, **SCHEDULE)
