"""The simulator's cost model, baseline, routing, presets and command, on cases small enough to
compute by hand (no timing: every figure here is a formula of the inputs)."""
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from shardmoe.moe.config import MoEConfig
from shardmoe.simulate import command
from shardmoe.simulate.baseline import bulk_synchronous, step_seconds
from shardmoe.simulate.cost import CostScheduler
from shardmoe.simulate.presets import Hardware, ModelShape, resolve
from shardmoe.simulate.routing import popularity, routed_batch
from shardmoe.simulate.sweep import layout, simulate_point
from shardmoe.tasks.plan import Plan, Task, TaskType

HW = Hardware(peak_flops=1e12, gemm_efficiency=0.5, hbm_bandwidth=1e11, sms=4, nvlink_bandwidth=1e10,
              fabric_bandwidth=1e9, nvlink_latency=1e-6, fabric_latency=1e-5, gpus_per_node=2, tile_rows=128)


def _plan(peers=2, ranks_per_node=1, tokens=8, experts=2, top_k=1, hidden=256, ffn=128):
    config = MoEConfig(hidden, ffn, experts, top_k)
    batch = routed_batch(torch.full((experts,), 1.0 / experts, dtype=torch.float64), tokens, top_k, seed=0)
    return Plan(config, batch, tokens, peers=peers, ranks_per_node=ranks_per_node, block_m=tokens,
                block_n=max(hidden, ffn))


def test_one_gemm_tile_and_its_waves():
    plan = _plan()
    costs = CostScheduler(plan, HW, gpus=1, token_scale=1, processors=2)  # 2 SMs per processor
    tile = plan.row_tiles[0]
    task = Task(TaskType.postGEMM, tile.device, tile.sync_idx, 0, tile.expert, tile.peer)
    # out H=256 -> 2 column tiles of one padded 128-row tile; K = F = 128; one SM does 1e12*0.5/4
    tile_seconds = 2 * 128 * 128 * 128 / (1e12 * 0.5 / 4)
    assert costs.duration(task) == pytest.approx(1 * tile_seconds)  # 2 tiles on 2 SMs: one wave
    assert costs.flops == 2.0 * tile.size * 256 * 128  # useful FLOPs count real rows only
    pre = Task(TaskType.preGEMM, tile.device, tile.sync_idx, 0, tile.expert, tile.peer)
    # out 2F = 256 -> 2 tiles, K = H = 256: twice the time of a K=128 tile
    assert costs.duration(pre) == pytest.approx(2 * tile_seconds)


def test_transfers_queue_on_their_ports():
    plan = _plan(peers=2, ranks_per_node=1)  # two devices on two nodes: the fabric
    costs = CostScheduler(plan, HW, gpus=1, token_scale=1, processors=1)
    tile = next(t for t in plan.row_tiles if t.peer != t.device)
    delivery = SimpleNamespace(device=tile.device, tile=tile, kind="heap signal", remote=True)
    size = tile.size * 256 * 2
    first = costs.transfer(delivery, 0.0)
    assert first == pytest.approx(size / 1e9 + 1e-5)
    second = costs.transfer(delivery, 0.0)  # the same ports, still busy with the first
    assert second == pytest.approx(2 * size / 1e9 + 1e-5)
    assert costs.link_bytes["fabric"] == 2 * size
    gate = SimpleNamespace(device=tile.peer, tile=tile, kind="gate signal", remote=True)
    costs.transfer(gate, 0.0)
    assert costs.link_bytes["fabric"] == 2 * size + tile.size * 4


def test_bulk_synchronous_phases_wait_for_the_slowest_device():
    shape = ModelShape(hidden_size=256, ffn_size=128, num_experts=2, top_k=1, tokens_per_gpu=512)
    rows = torch.tensor([[0.0, 256.0], [0.0, 256.0]])  # every row goes to expert 1, on device 1
    phases = bulk_synchronous(rows, shape, HW, gpus=1, node_of=lambda d: d)
    # device 1 computes all 512 rows (4 tiles); device 0 nothing: the phase is device 1's time
    flops = 2 * 512 * (256 * 256 + 128 * 256)
    assert phases["forward experts"] > flops / (1e12 * 0.5)
    assert phases["backward experts"] == pytest.approx(2 * phases["forward experts"])
    # device 0 sends 256 rows across nodes; device 1's own rows stay home
    assert phases["forward dispatch"] == pytest.approx(256 * 256 * 2 / 1e9 + 1e-5)


def test_routing_generators():
    uniform = popularity("uniform", 8)
    assert torch.allclose(uniform, torch.full((8,), 1 / 8, dtype=torch.float64))
    for bad in ("nan", "inf", "-1"):
        with pytest.raises(ValueError, match=f"the zipf exponent must be a finite number >= 0, got '{bad}'"):
            popularity(f"zipf:{bad}", 8)
    zipf = popularity("zipf:1.0", 8, seed=3)
    assert zipf.sum().item() == pytest.approx(1.0)
    assert sorted(zipf.tolist(), reverse=True)[0] / sorted(zipf.tolist())[0] == pytest.approx(8.0)
    batch = routed_batch(zipf, 100, 3, seed=1)
    assert batch.top_idx.shape == (100, 3) and batch.row_pair.numel() == 300
    assert all(len(set(row)) == 3 for row in batch.top_idx.tolist())  # distinct experts per token
    experts_in_row_order = batch.top_idx.reshape(-1)[batch.row_pair]
    assert torch.equal(experts_in_row_order, experts_in_row_order.sort().values)
    with pytest.raises(ValueError, match="zipf exponent must be a finite number >= 0"):
        popularity("zipf:-1", 8)
    with pytest.raises(ValueError, match="expected uniform, zipf:EXPONENT or replay"):
        popularity("skewed", 8)


def test_replay_reads_a_training_run_and_resamples(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "expert_tokens": [[30, 10, 10, 10], [25, 15, 10, 10]]},
            {"step": 2, "loss": 1.0},  # a row without the column is skipped
            {"step": 3, "expert_tokens": [[35, 5, 10, 10], [30, 10, 10, 10]]}]
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    same = popularity(f"replay:{metrics}", 4)
    assert sorted(same.tolist(), reverse=True) == pytest.approx([120 / 240, 40 / 240, 40 / 240, 40 / 240])
    wider = popularity(f"replay:{metrics}", 7)
    assert wider.numel() == 7 and wider.sum().item() == pytest.approx(1.0)
    assert max(wider.tolist()) / min(wider.tolist()) == pytest.approx(3.0)  # the skew carries over
    with pytest.raises(ValueError, match="no file"):
        popularity(f"replay:{tmp_path / 'missing.jsonl'}", 4)


def test_layout_aggregates_nodes_and_scales_tokens():
    shape = ModelShape(7168, 2048, 256, 8, tokens_per_gpu=4096)
    hw = Hardware()
    small = layout(8, shape, hw)
    assert small["devices"] == 8 and small["gpus_per_device"] == 1
    big = layout(1024, shape, hw)
    assert big["ep"] == 256 and big["replicas"] == 4 and big["devices"] == 32 and big["gpus_per_device"] == 8
    for lay in (small, big):
        assert lay["tokens"] * lay["token_scale"] == lay["ep"] * shape.tokens_per_gpu
        assert lay["block_m"] * lay["token_scale"] == hw.tile_rows * lay["gpus_per_device"]
    with pytest.raises(ValueError, match="must divide both"):
        layout(96, shape, hw)


def test_presets_and_overrides(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[hardware]\nfabric_bandwidth = 25e9\n[model]\ntokens_per_gpu = 1024\n")
    hw, shape = resolve("h100", "mixtral-8x7b", str(toml), ["top_k=1", "sms=100"])
    assert hw.fabric_bandwidth == 25e9 and hw.sms == 100 and shape.tokens_per_gpu == 1024 and shape.top_k == 1
    with pytest.raises(ValueError, match="unknown setting 'flops'"):
        resolve("h100", "mixtral-8x7b", settings=["flops=1"])
    with pytest.raises(ValueError, match="expected a positive finite number"):
        resolve("h100", "mixtral-8x7b", settings=["sms=0"])
    for bad in ("nan", "inf", "-inf"):  # NaN passed a <= 0 check and printed schedules at 457 % of peak
        for name in ("fabric_bandwidth", "nvlink_bandwidth", "peak_flops"):
            with pytest.raises(ValueError, match=f"--set: {name} expected a positive finite number, got '{bad}'"):
                resolve("h100", "mixtral-8x7b", settings=[f"{name}={bad}"])
    toml.write_text("[hardware]\nfabric_bandwidth = nan\n")
    with pytest.raises(ValueError, match="fabric_bandwidth expected a positive finite number"):
        resolve("h100", "mixtral-8x7b", str(toml))
    with pytest.raises(ValueError, match="--preset: expected one of"):
        resolve("h100", "gpt-5")


def test_command_writes_table_json_and_png(tmp_path, capsys):
    parser = __import__("argparse").ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--preset", "mixtral-8x7b", "--gpus", "2,4", "--set", "tokens_per_gpu=256",
                              "--set", "hidden_size=512", "--set", "ffn_size=1024", "--out", str(tmp_path)])
    assert command.run(args) == 0
    table = capsys.readouterr().out
    assert "speedup" in table and len(table.splitlines()) >= 3
    report = json.loads((tmp_path / "simulate.json").read_text())
    assert [p["gpus"] for p in report["points"]] == [2, 4]
    for point in report["points"]:
        assert point["tile_seconds"] > 0 and point["bulk_seconds"] > 0
        assert 0 < point["tile_fraction_of_peak"] <= 1 and 0 < point["bulk_fraction_of_peak"] <= 1
    assert (tmp_path / "simulate.png").stat().st_size > 0
    with pytest.raises(ValueError, match="--gpus: expected comma-separated integers"):
        command.parse_gpus("8,many")


def test_command_names_model_and_hardware_shows_progress_and_writes_only_when_asked(tmp_path, monkeypatch, capsys):
    """It was silent for ~19 s, its table named neither model nor hardware, and it wrote
    runs/simulate/ unasked."""
    monkeypatch.chdir(tmp_path)
    parser = __import__("argparse").ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--preset", "mixtral-8x7b", "--gpus", "2,4,8", "--set", "tokens_per_gpu=256",
                              "--set", "hidden_size=512"])
    command.check_arguments(args)
    assert command.run(args) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == (
        "simulating one MoE layer, forward + backward: mixtral-8x7b (H 512, F 14336, E 8, top-2, 256 tokens per "
        "GPU), uniform routing, on h100 GPUs (989 TFLOP/s peak x 0.7, HBM 3.35 TB/s, NVLink 450 GB/s, fabric 50 GB/s "
        "per GPU, 8 per node)")
    assert "simulating: 100%" in captured.err and "3/3" in captured.err  # one step per EP size
    assert list(tmp_path.iterdir()) == []


def test_simulated_point_keeps_the_runtime_task_counts():
    """The cost model only prices tasks: the schedule still emits the closed-form counts
    (simulate_forward/backward check them) and the useful FLOPs match the routing's rows."""
    shape = ModelShape(256, 512, 4, 2, tokens_per_gpu=64)
    point = simulate_point(2, shape, HW)
    rows = 2 * 64 * 2
    expected = 3 * 2 * rows * (256 * 1024 + 512 * 256) + 3 * 2 * (rows / 2) * 256 * 4
    assert point["tile_fraction_of_peak"] * point["tile_seconds"] * 2 * HW.peak_flops == pytest.approx(expected)
    assert math.isfinite(point["speedup"]) and point["tasks"] > 0


def test_calibration_prediction_is_the_baseline_at_measured_rates():
    """With memory traffic free (huge copy rate) and one rank, the predicted step is the GEMM FLOPs
    of experts and gate (forward, and twice that backward) over the measured GEMM rate."""
    from shardmoe.simulate.calibrate import predict
    shape = ModelShape(hidden_size=64, ffn_size=96, num_experts=4, top_k=2, tokens_per_gpu=128)
    hw = Hardware(peak_flops=1e9, gemm_efficiency=1.0, hbm_bandwidth=1e30, tile_rows=1, kernel_launch=0.0,
                  host_sync=0.0)
    rows, tokens = 128 * 2, 128
    flops = 3 * 2 * rows * (64 * 2 * 96 + 96 * 64) + 3 * 2 * tokens * 64 * 4
    assert predict(shape, hw, 1) == pytest.approx(flops / 1e9, rel=1e-9)
    assert predict(shape, hw, 2) > predict(shape, hw, 1)  # the same work per rank plus the exchanges


def test_calibration_host_overhead_is_the_unpriced_part_of_a_small_step():
    """The fixed cost per step is what a measured near-empty step takes beyond the model's price
    for it, never negative; with it as host_sync (paid in forward and backward), the model
    reproduces that small step exactly."""
    from shardmoe.simulate.calibrate import SHAPE, SMALL_TOKENS, _host_overhead, predicted_phases
    hw = Hardware(peak_flops=1e9, gemm_efficiency=1.0, hbm_bandwidth=1e10, tile_rows=1, kernel_launch=0.0,
                  host_sync=0.0, gpus_per_node=2)
    loads = [SMALL_TOKENS * SHAPE.top_k // SHAPE.num_experts] * SHAPE.num_experts
    small = dataclasses.replace(SHAPE, tokens_per_gpu=SMALL_TOKENS)
    priced = step_seconds(predicted_phases(small, hw, 1, torch.tensor(loads)))
    overhead = _host_overhead(hw, 1, {"small_step": priced + 0.005, "small_per_expert": loads})
    assert overhead == pytest.approx(0.005)
    with_host = dataclasses.replace(hw, host_sync=overhead / 2)
    assert step_seconds(predicted_phases(small, with_host, 1, torch.tensor(loads))) == pytest.approx(priced + 0.005)
    assert _host_overhead(hw, 1, {"small_step": priced / 2, "small_per_expert": loads}) == 0.0
