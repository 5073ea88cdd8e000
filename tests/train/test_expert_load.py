"""The load columns of metrics.jsonl and the expert-load heatmap.

The logged tokens per expert are checked against counts recomputed independently: the weights
before step n (a run stopped after n - 1 steps), batch n of the data stream, each MoE layer's input
captured by a hook, and top-k of x . gate_weight in float64 counted with bincount. A 2-rank world
(d = 2 and e = 2 in turn) must log the same global counts as the single process.
"""
import json
import struct

import pytest
import torch

from shardmoe.mesh import Mesh
from shardmoe.testing import run_distributed
from shardmoe.train import plots
from shardmoe.train.loop import build_streams, train
from shardmoe.train.metrics import METRICS_FILE, load_columns

from .conftest import single_threaded, tiny_train_config

STEPS = 3


def float64_config():
    return tiny_train_config(steps=STEPS, dtype="float64", eval_batches=0, health_every=0)


def recomputed_counts(config, steps):
    """[step][layer][expert] tokens per expert, from the router's top-k (dropless) on each layer's input."""
    stream = build_streams(config)[0]
    counts = []
    for step in range(1, steps + 1):
        model = train(config, None, stop_after=step - 1, progress=False).model  # the weights before step n
        batch = next(stream)
        inputs = []
        hooks = [block.moe.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
                 for block in model.blocks]
        with torch.no_grad():
            model(batch.ids, batch.is_seq_start, batch.targets)
        for hook in hooks:
            hook.remove()
        layers = []
        for x, block in zip(inputs, model.blocks):
            scores = x.reshape(-1, x.shape[-1]).double() @ block.moe.gate_weight.double()
            chosen = scores.topk(config.model.moe.top_k, dim=-1).indices.reshape(-1)
            layers.append(torch.bincount(chosen, minlength=config.model.moe.num_experts).tolist())
        counts.append(layers)
    return counts


def read_rows(out_dir):
    return [json.loads(line) for line in (out_dir / METRICS_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """(rows of metrics.jsonl, recomputed counts) of the float64 tiny run on one process and one thread."""
    with single_threaded():
        config, out = float64_config(), tmp_path_factory.mktemp("single")
        train(config, out, progress=False)
        return read_rows(out), recomputed_counts(config, STEPS)


def test_logged_loads_equal_the_recomputed_counts(single_process):
    rows, counts = single_process
    config = float64_config()
    assert [r["expert_tokens"] for r in rows] == counts
    for row, step_counts in zip(rows, counts):
        for layer in step_counts:  # every (token, choice) pair of the global batch, once
            assert sum(layer) == config.batch_size * config.seq_len * config.model.moe.top_k
        ratios = [max(c) / (sum(c) / len(c)) for c in step_counts]
        assert row["load_max_over_mean"] == pytest.approx(ratios, rel=1e-15)
        assert row["worst_load_max_over_mean"] == max(row["load_max_over_mean"])
    assert max(r["worst_load_max_over_mean"] for r in rows) > 1.0  # the counts are not trivially balanced


def _train_layouts(layouts, out_dirs):
    for layout, out in zip(layouts, out_dirs):
        train(float64_config(), out, mesh=Mesh(*layout), progress=False)


def test_two_ranks_log_the_global_counts(single_process, tmp_path, one_thread):
    rows, counts = single_process
    layouts = [(2, 1, 1), (1, 2, 1)]  # (d, e, t): tokens split over d, then over e
    out_dirs = [tmp_path / f"d{d}e{e}t{t}" for d, e, t in layouts]
    run_distributed(_train_layouts, 2, args=(layouts, [str(o) for o in out_dirs]), timeout=180)
    for layout, out in zip(layouts, out_dirs):
        logged = read_rows(out)  # rank 0's file
        assert [r["expert_tokens"] for r in logged] == counts, layout
        assert [r["load_max_over_mean"] for r in logged] == [r["load_max_over_mean"] for r in rows], layout


def png_size(path):
    """(width, height) in pixels from the PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def heatmap_panels(path):
    """Bands of colour-mapped pixels down a column through the heatmaps' middle: one per panel.
    Text, ticks and frames are grey or black; viridis cells are saturated colours."""
    import matplotlib.image

    image = matplotlib.image.imread(str(path))[..., :3]
    column = image[:, int(image.shape[1] * 0.45)]
    coloured = (column.max(axis=1) - column.min(axis=1)) > 0.15
    bands, run = 0, 0
    for pixel in list(coloured) + [False]:
        if pixel:
            run += 1
        else:
            bands += run > 10
            run = 0
    return bands


@pytest.mark.parametrize("layers", [2, 3])
def test_heatmap_has_one_panel_per_layer_and_the_documented_size(single_process, tmp_path, layers):
    rows, _ = single_process
    if layers != 2:  # the tiny model has two layers; a third from a permuted copy of the first
        rows = [{"step": r["step"], **load_columns([torch.tensor(c) for c in
                                                    r["expert_tokens"] + [r["expert_tokens"][0][::-1]]])}
                for r in rows]
    path = plots.plot_expert_load(rows, tmp_path / "expert_load.png", title="tiny")
    height = plots.LOAD_MARGIN + plots.LOAD_PANEL * layers
    assert png_size(path) == (round(plots.LOAD_WIDTH * plots.DPI), round(height * plots.DPI))
    assert heatmap_panels(path) == layers


def test_rows_without_load_columns_are_not_drawn(tmp_path):
    assert plots.plot_expert_load([{"step": 1, "loss": 5.0}], tmp_path / "expert_load.png") is None
    assert not (tmp_path / "expert_load.png").exists()
