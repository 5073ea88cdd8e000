"""python -m shardmoe.tools.gpu_check: its dry run end to end (CPU, tiny shapes, Triton's interpreter) into
a temporary directory, the content of report.json and report.md for every stage, the argument
errors, the runner's isolation of a failing stage, merging reports, and the compiled-mode switch
of tests/kernels/conftest.py."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

from shardmoe.tools import gpu_check
from shardmoe.tools.gpu_check import (bench, model, parity, pytest_stage, runner, sanitize, sanitizer, static, sweep,
                                      traffic, train)

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's two long commands, started together when either is first needed: the dry run
    (mostly one core, the interpreter) and `--only static` (compiles in the background meanwhile):
    {name: (process, its log, its output directory)}."""
    root = tmp_path_factory.mktemp("gpu_check")
    commands = {"dry_run": (["--dry-run", "--out", str(root / "report")], ENV),
                "static": (["--out", str(root / "static"), "--only", "static"],
                           {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"})}
    started = {}
    for name, (argv, env) in commands.items():
        log = open(root / f"{name}.log", "w+")  # a file, not a pipe: neither waits for its reader
        started[name] = (subprocess.Popen([sys.executable, "-m", "shardmoe.tools.gpu_check", *argv], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT, text=True),
                         log, Path(argv[argv.index("--out") + 1]))
    yield started
    for process, log, _ in started.values():
        process.kill()
        process.wait()
        log.close()


def finished(runs, name: str, timeout: float) -> tuple[int, str, dict, str, Path]:
    """(exit code, output, report.json, report.md, the directory) of one of `runs`' commands."""
    process, log, out = runs[name]
    process.wait(timeout=timeout)
    log.seek(0)
    return process.returncode, log.read(), json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), out


@pytest.fixture(scope="module")
def dry_run(runs):
    """(exit code, output, report.json, report.md, the directory) of one dry run."""
    return finished(runs, "dry_run", timeout=900)


def test_dry_run_passes_every_stage_and_skips_only_the_sanitizer_and_static(dry_run):
    code, output, report, _, _ = dry_run
    assert code == 0, output
    assert list(report["stages"]) == list(gpu_check.STAGE_NAMES)
    statuses = {name: entry["status"] for name, entry in report["stages"].items()}
    assert statuses == {"env": "ok", "static": "skipped", "traffic": "ok", "tests": "ok", "sanitizer": "skipped",
                        "parity": "ok", "train": "ok", "bench": "ok", "sweep": "ok", "model": "ok", "calibrate": "ok"}, output
    assert "--only static" in report["stages"]["static"]["note"]
    assert report["runs"][0]["dry_run"] is True and report["runs"][0]["device"] == "cpu"
    assert all(entry["error"] is None for entry in report["stages"].values())
    assert all(entry["seconds"] > 0 for name, entry in report["stages"].items() if name != "static")


def test_env_records_versions_and_the_interpreter(dry_run):
    env = dry_run[2]["stages"]["env"]["result"]
    assert env["torch"] == torch.__version__
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["triton_interpret"] == "1" and env["device"] == "cpu" and env["cuda_available"] is False


def test_tests_stage_ran_the_tiny_selection_in_the_interpreter(dry_run):
    result = dry_run[2]["stages"]["tests"]["result"]
    assert result["compiled"] is False
    [group] = result["groups"]
    assert group["paths"] == ["tests/kernels/test_kernel_path.py", "tests/kernels/test_activations.py"]
    assert group["returncode"] == 0 and group["failures"] == 0 and group["errors"] == 0
    assert group["passed"] > 10 and result["totals"]["passed"] == group["passed"]
    assert (dry_run[4] / group["log"]).exists()


def test_sanitizer_stage_says_why_it_skipped_and_ran_its_workload(dry_run):
    entry = dry_run[2]["stages"]["sanitizer"]
    assert "no CUDA device" in entry["note"]
    lines = entry["result"]["workload"]
    assert len(lines) == len(sanitize.WORKLOAD)
    assert all(": triton, " in line and line.endswith("gradients finite") for line in lines)


def test_parity_table_has_every_case_and_dtype_within_tolerance(dry_run):
    rows = dry_run[2]["stages"]["parity"]["result"]["rows"]
    assert [(r["case"], r["dtype"]) for r in rows] == [(c, d) for c in parity.CASES for d in parity.DTYPES]
    for r in rows:
        tol_reference, tol_torch = parity.TOLERANCES[r["dtype"]]
        assert r["passed"] and not r["problems"], r
        assert r["backend"] == "triton"
        assert {"out", "aux_loss", "x", "gate_weight"} <= set(r["errors"])
        for key, err in r["errors"].items():
            assert err["vs_reference"] <= tol_reference and err["vs_torch"] <= tol_torch, (r["case"], key, err)
        case = parity.CASES[r["case"]]
        if case.no_tokens:
            assert r["tokens"] == 0
        else:
            assert r["tokens_per_expert"][parity.EMPTY] == 0 and sum(r["tokens_per_expert"]) > 0
        if case.options.get("capacity_factor"):
            assert r["dropped"] > 0
    float32 = [err["vs_reference"] for r in rows if r["dtype"] == "float32" for err in r["errors"].values()]
    assert max(float32) < 1e-5


@pytest.mark.parametrize("value", [float("nan"), 1e-2])
def test_a_wrong_kernel_output_fails_its_row(monkeypatch, value):
    """The row fails when the kernel path's output is off by 1e-2 relative or NaN (a NaN compared
    below every tolerance before: NaN > tol is False)."""
    real = parity.forward_backward
    calls = []

    def corrupted(layer, x, grad_out, context):
        backend, tensors, stats = real(layer, x, grad_out, context)
        if not calls:  # the first run is the kernel path's
            out = tensors["out"]
            tensors["out"] = out + value * out.abs().max() if value == value else torch.full_like(out, value)
        calls.append(backend)
        return backend, tensors, stats

    monkeypatch.setattr(parity, "forward_backward", corrupted)
    name = "glu-softmax-aux-z"
    row = parity.check_case(name, parity.CASES[name], "float32", "cpu", parity.DRY_RUN_SIZES)
    assert calls == ["triton", "torch"] and not row["passed"]
    assert row["worst"]["vs_reference"][0] == "out" and row["worst"]["vs_reference"][1] >= 1e-2
    assert any(p.startswith("out: error vs float64") for p in row["problems"]), row["problems"]


def test_bench_times_every_candidate_and_prints_sonicmoe_beside_ours(dry_run):
    cases = dry_run[2]["stages"]["bench"]["result"]["cases"]
    assert [c["shape_name"] for c in cases] == list(bench.DRY_RUN_SHAPES)
    for c in cases:
        rows = {r["candidate"]: r for r in c["rows"]}
        assert set(rows) == {"dense", "grouped_mm", "shardmoe", "shardmoe:torch"}
        for r in rows.values():
            assert r["median_ms"] > 0 and r["tflops"] > 0 and r["repeats"] == bench.DRY_RUN_REPEATS
        for name in ("grouped_mm", "shardmoe", "shardmoe:torch"):
            assert rows[name]["forward_ms"] > 0 and rows[name]["backward_ms"] > 0
        assert c["backends"] == {"shardmoe": "triton", "shardmoe:torch": "torch"}
        assert set(c["errors"]) == {"shardmoe vs shardmoe:torch",
                                    "shardmoe vs grouped_mm", "shardmoe:torch vs grouped_mm"}
        assert all(math.isfinite(err) for err in c["errors"].values())
        assert c["errors"]["shardmoe vs shardmoe:torch"] < bench.CHECK_TOL and not c["problems"]
        float64 = c["float64_errors"]
        assert set(float64) == {"grouped_mm", "shardmoe", "shardmoe:torch"}
        assert c["checked"] == ["shardmoe", "shardmoe:torch"] and c["check_tol"] == bench.CHECK_TOL
        for name, errors in float64.items():
            assert set(errors) == {"y", "x", "router", "gate_up", "down"}, name
            assert all(math.isfinite(err) and err > 0 for err in errors.values()), (name, errors)
        assert max(max(float64[name].values()) for name in bench.CHECKED) < bench.CHECK_TOL
    sonic = cases[1]["sonicmoe"]
    assert sonic["same_shape"] is False and sonic["shardmoe_forward_tflops"] > 0


def test_sweep_times_the_three_paths_at_every_width(dry_run):
    from shardmoe.kernels import KERNEL_MAX_FFN

    result = dry_run[2]["stages"]["sweep"]["result"]
    assert result["ffns"] == list(sweep.DRY_RUN_FFNS) and not result["left_out"] and result["passed"]
    assert result["shape"] == {"tokens": 64, "hidden": 32, "experts": 4, "top_k": 2}
    assert [r["ffn"] for r in result["rows"]] == list(sweep.DRY_RUN_FFNS)
    for r in result["rows"]:
        assert set(r["median_ms"]) == set(sweep.PATHS) and all(ms > 0 for ms in r["median_ms"].values()), r
        assert r["repeats"] == bench.DRY_RUN_REPEATS
        assert r["backends"] == {"shardmoe": "triton", "shardmoe:torch": "torch"}
        assert not r["problems"] and all(0 < err < bench.CHECK_TOL for err in r["errors"].values()), r
        assert r["torch_over_kernels"] == pytest.approx(r["median_ms"]["shardmoe:torch"] / r["median_ms"]["shardmoe"])
    assert "crossover_ffn" in result and result["crossover_ffn"] == sweep.crossover(result["rows"])
    assert result["kernel_max_ffn"] == KERNEL_MAX_FFN
    md = dry_run[3]
    assert "| F | kernels ms | torch ms | torch/kernels |" in md
    assert f"kernels.KERNEL_MAX_FFN is {KERNEL_MAX_FFN} (not changed by this stage)" in md


def test_sweep_crossover_and_budget(monkeypatch):
    """The crossover is the widest F at which the kernels are not slower; F values past the budget
    are listed as not run and fail the stage."""
    def row(ffn, kernels_ms, torch_ms=10.0):
        return {"ffn": ffn, "median_ms": {"shardmoe": kernels_ms, "shardmoe:torch": torch_ms}, "repeats": 2,
                "backends": {}, "errors": {}, "torch_over_kernels": torch_ms / kernels_ms, "problems": []}

    assert sweep.crossover([row(16, 5), row(32, 10), row(48, 11)]) == 32
    assert sweep.crossover([row(16, 11)]) is None
    measured = {16: row(16, 5), 32: row(32, 9)}
    monkeypatch.setattr(sweep, "measure", lambda s, ctx: measured[s.ffn])
    progress = []
    ctx = types.SimpleNamespace(dry_run=True, device="cpu", out_of_time=lambda: len(progress) >= 2,
                                progress=lambda partial: progress.append(len(partial["rows"])))
    result = sweep.run(ctx)
    assert progress == [1, 2] and result["left_out"] == [48] and result["passed"] is False
    assert result["crossover_ffn"] == 32
    md = "\n".join(sweep.markdown(result))
    assert "up to F=32 (the widest measured)" in md and "Not run (budget spent): F = 48" in md


def test_a_wrong_kernel_output_is_a_sweep_problem_and_the_timing_still_runs(monkeypatch):
    real, calls = bench.check_step, []

    def corrupted(c, context, grad):
        result = real(c, context, grad)
        calls.append(len(calls))
        if len(calls) == 1:  # shardmoe, the first path checked
            result["x"] = result["x"] * 1.1
        return result

    monkeypatch.setattr(bench, "check_step", corrupted)
    ctx = types.SimpleNamespace(dry_run=True, device="cpu")
    row = sweep.measure(dataclasses.replace(sweep.DRY_RUN_SHAPE, ffn=16), ctx)
    assert len(calls) == 2
    assert row["problems"] == [f"F=16: shardmoe vs shardmoe:torch: error "
                               f"{row['errors']['shardmoe vs shardmoe:torch']:.2e} > {bench.CHECK_TOL:g}"]
    assert all(ms > 0 for ms in row["median_ms"].values())


def test_model_stage_steps_both_implementations_on_the_triton_path(dry_run):
    result = dry_run[2]["stages"]["model"]["result"]
    assert result["family"] == "qwen3_moe" and result["sizes"] == dataclasses.asdict(model.DRY_RUN_MODEL)
    assert result["backends"] == ["triton"] and not result["problems"] and result["passed"]
    assert set(result["median_ms"]) == set(model.IMPLEMENTATIONS) and all(ms > 0 for ms in result["median_ms"].values())
    assert result["grouped_mm_over_shardmoe"] == pytest.approx(result["median_ms"]["grouped_mm"]
                                                              / result["median_ms"]["shardmoe"])
    # the same weights: the two losses agree to bf16 round-off; the gradients' distance is reported only
    # (grouped_mm routes in bf16: 8.7e-2 apart at these tiny sizes)
    assert result["loss_rel_diff"] < 1e-2 and 0 < result["grad_rel_error"] < math.inf
    assert "grouped_mm / shardmoe:" in dry_run[3]


def test_traffic_model_rows_calibration_and_the_fine_step(dry_run):
    """The traffic stage's model at the bench's full shapes (it needs no GPU): a step row per shape and
    device with the issue's fields, a calibration row per kernel and shape against the stored 206ae40
    per-kernel times with its error, and the fine step as the grouped tile order leaves it: at most
    4.0 ms modelled on an H100 with DRAM traffic at most 1.5x the compulsory bytes (the model with the
    row tile fastest gives 6.8 ms and 3.2x)."""
    from shardmoe.tools.gpu_check.lease_profiles import PROFILES_206AE40

    result = dry_run[2]["stages"]["traffic"]["result"]
    steps = {(r["shape"], r["device"]): r for r in result["steps"]}
    assert set(steps) == {(s, d.name) for s in traffic.SHAPE_NAMES for d in traffic.DEVICES}
    for r in steps.values():
        assert {"shape", "device", "modelled_ms", "dram_bytes", "compulsory_bytes"} <= set(r)
        assert 0 < r["roofline_ms"] <= r["modelled_ms"] and r["dram_bytes"] >= r["compulsory_bytes"] > 0
    assert steps[("fine", "H200")]["modelled_ms"] <= steps[("fine", "H100")]["modelled_ms"]
    fine = steps[("fine", "H100")]
    assert fine["modelled_ms"] <= 4.0 and fine["dram_bytes"] <= 1.5 * fine["compulsory_bytes"], fine
    row_first = fine["row_tile_fastest"]
    assert row_first["modelled_ms"] > 6.0 and row_first["dram_bytes"] > 3 * fine["compulsory_bytes"], row_first
    rows = result["calibration"]
    assert {(r["kernel"], r["shape"]) for r in rows} == {(k, s) for s, ks in PROFILES_206AE40.items() for k in ks}
    for r in rows:
        assert {"kernel", "shape", "measured_ms", "modelled_ms"} <= set(r)
        assert r["error"] == pytest.approx(r["modelled_ms"] / r["measured_ms"] - 1)
    assert 0 < result["efficiency"]["flops"] <= 1 and 0 < result["efficiency"]["bytes"] <= 1
    assert "measured" not in result  # no GPU: nothing measured
    assert "A model, not a measurement" in dry_run[3] and "| kernel | shape | measured ms | modelled ms | error |" in dry_run[3]


def test_traffic_counts_the_gathered_gemm_bytes_as_by_hand(dry_run):
    """The fine shape's first GEMM (x gathered through the token index, GLU, bf16): its FLOPs, its
    compulsory bytes (x read once in token order, S rows not N; gate_up_proj read once; h and a written
    once), the denominator of the fine step's DRAM / compulsory ratio above, and DRAM bytes at least
    the N gathered rows, the weights and the outputs."""
    traced = json.loads((dry_run[4] / "traffic.json").read_text())
    s, bf16 = bench.SHAPES["fine"], 2
    n = s.tokens * s.top_k
    record, row = next((r, c) for r, c in traced["fine"] if r["name"] == "forward_gemm_kernel" and r["args"]["GLU"])
    launch = traffic.model_launch(record, row, traffic.DEVICES[0])
    weights = s.experts * 2 * s.ffn * s.hidden
    assert launch.flops == 2 * n * s.hidden * 2 * s.ffn
    assert launch.compulsory_bytes == bf16 * (s.tokens * s.hidden + weights + n * 2 * s.ffn + n * s.ffn)
    assert launch.dram_bytes >= bf16 * (n * s.hidden + weights + n * 3 * s.ffn)


def test_traffic_on_a_lease_puts_measured_beside_modelled_and_refits(dry_run):
    """What a lease adds (the kernels measured per kernel and step, here given): a row per measured
    kernel and shape with its modelled time, the efficiencies refitted to them, and a measured kernel the
    model has no launch of left out."""
    traced = json.loads((dry_run[4] / "traffic.json").read_text())
    measured = {"fine": {"forward_gemm_kernel": 1.2, "weight_grad_kernel": 0.9, "gate_dots_kernel": 0.1},
                "mixtral": {"grad_gemm_kernel": 8.0}}
    result = traffic.model(traced, measured)
    rows = result["lease_calibration"]["rows"]
    assert [(r["kernel"], r["shape"], r["measured_ms"]) for r in rows] == [
        ("forward_gemm_kernel", "fine", 1.2), ("weight_grad_kernel", "fine", 0.9), ("grad_gemm_kernel", "mixtral", 8.0)]
    assert all(r["modelled_ms"] > 0 for r in rows) and result["measured"] == measured
    # the weight gradient's rate (a done-when in TFLOP/s): its launches' FLOPs over the measured time
    dw_flops = sum(x["flops"] for x in result["launches"] if x["shape"] == "fine" and x["kernel"] == "weight_grad_kernel")
    assert rows[1]["measured_tflops"] == pytest.approx(dw_flops / 0.9e-3 / 1e12)
    assert 0 < result["lease_calibration"]["efficiency"]["flops"] <= 1
    assert any(line.startswith("This lease's kernels, measured and modelled side by side")
               for line in traffic.markdown(result))


def test_traffic_measure_runs_the_layer_on_the_kernel_path():
    """The lease's measurement at a tiny shape in the interpreter: the layer's steps run under the
    profiler (no kernel is a device event on a CPU, so nothing is timed: one step shows the path)."""
    assert traffic.measure("cpu", {"tiny": bench.DRY_RUN_SHAPES["fine"]}, warmup=0, steps=1) == {"tiny": {}}


def test_wave_bytes_reads_a_tile_once_per_wave_that_needs_it():
    programs = [(((("A", 0), 10), (("W", 0), 1)), 2)] * 3 + [(((("A", 1), 10), (("W", 0), 1)), 2)]
    assert traffic.wave_bytes(programs, 4) == 10 + 1 + 10 + 4 * 2  # one wave: W once, A0 once
    assert traffic.wave_bytes(programs, 2) == (10 + 1) * 2 + 10 + 4 * 2  # A0 and W again in the second wave
    h100 = traffic.DEVICES[0]
    # registers: 65536 / (136 x 256) = 1 program an SM; 128 registers and 96 KB of shared memory: 2
    assert traffic.resident(h100, 130, 1024, 8) == 132 and traffic.resident(h100, 128, 96 * 1024, 8) == 264


def test_grouped_order_reads_fewer_bytes_than_the_row_tile_fastest():
    """400 row tiles of 4 experts by 24 column tiles, 132 programs a wave: with the row tile fastest a
    wave is 132 row tiles of one column tile, so every row tile is read 24 times; grouped by 8 rows a
    wave is 8 row tiles by 16.5 column tiles (3.2x the row operand's bytes in all, weights included)."""
    sizes, private = [12800] * 4, (lambda rows, cols: 0)

    def dram(order):
        return traffic.wave_bytes(traffic.row_tiled(sizes, 128, 64, 1536, 400, order, 1024, 512, private), 132)

    grouped, rows = dram(traffic.grouped_order(8)), dram(traffic.row_fastest)
    a_once = 400 * 128 * 1024
    assert rows >= 24 * a_once and grouped < 4 * a_once


def test_train_stage_trains_both_presets_and_resumes_bitwise(dry_run):
    """The dry run's train stage: both presets trained through the loop (the tiny model in their
    place; mixtral-1gpu in bf16 autocast), each check made and holding: bf16 against fp32, the
    device against the CPU (both the CPU here), the repeat and the resume bitwise."""
    result = dry_run[2]["stages"]["train"]["result"]
    assert [r["run"] for r in result["runs"]] == list(train.PRESETS)
    assert [r["dtype"] for r in result["runs"]] == ["float32", "bfloat16"]
    for r in result["runs"]:
        assert r["steps"] == train.DRY_RUN["steps"] and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1, r
        assert r["model"]["d_model"] == train.DRY_RUN["model"]["d_model"] and r["peak_gib"] is None
    checks = result["checks"]
    assert [c["check"].split(":")[0] for c in checks] == ["mixtral-1gpu", "default", "default", "default"]
    assert all(c["passed"] for c in checks) and not result["left_out"] and result["passed"], checks
    assert checks[1]["max_rel_diff"] == 0.0  # the CPU against itself
    assert "- default: stopped at 2, resumed to 3, bitwise: bitwise: ok" in dry_run[3]


def test_train_stage_names_a_failed_check_and_what_the_budget_left_out(monkeypatch, tmp_path):
    """A resumed run whose loss differs at one step, a bf16 run 5 % off fp32: both named; once the
    budget is spent the runs not started are listed, and the stage fails."""
    def rows(steps, shift_at=None, scale=1.0):
        return [{"step": s, "loss": (2.0 + (1e-9 if s == shift_at else 0)) * scale, "aux_loss": 0.0, "lr": 0.1,
                 "grad_norm": 1.0, "dropped_tokens": 0, "expert_tokens": [[1]], "tokens_per_s": 10.0, "mfu": 0.5,
                 "seconds": 1.0} for s in range(1, steps + 1)]

    def fake_run(values, out=None, stop_after=None, resume=False):
        steps = stop_after or values["steps"]
        shifted = 3 if resume else None
        made = rows(steps, shifted, 1.05 if values.get("dtype") == "float32" and values["arch"] != "mixtral" else 1.0)
        return {"rows": made, "peak_gib": None, "peak_source": "a stand-in", "peak_flops": 1.0, "seconds": 1.0,
                "log_every": 1, "dtype": values.get("dtype", "float32"), "tokens_per_step": 64, "model": {}}

    monkeypatch.setattr(train, "train_run", fake_run)
    progress = []
    ctx = types.SimpleNamespace(dry_run=True, device="cpu", out=tmp_path, out_of_time=lambda: False,
                                progress=lambda partial: progress.append(len(partial["runs"])))
    result = train.run(ctx)
    assert not result["passed"] and progress == [1, 2, 2, 2, 2]
    assert result["problems"][0].startswith("mixtral-1gpu: bf16 against fp32 on cpu: relative loss difference 4.76e-02")
    assert result["problems"][1:] == ["default: stopped at 2, resumed to 3, bitwise: first differs at step 3"]

    spent = iter([False, True, True, True, True])
    ctx.out_of_time = lambda: next(spent)
    result = train.run(ctx)
    assert result["left_out"] == ["mixtral-1gpu", "precision", "cpu", "resume"] and not result["passed"]
    assert result["problems"] == ["not run (budget spent, or what it compares with was not run): mixtral-1gpu, "
                                  "precision, cpu, resume"]


def test_bench_reports_host_syncs_only_on_cuda(dry_run):
    assert all(c["host_sync"] is None for c in dry_run[2]["stages"]["bench"]["result"]["cases"])


@pytest.fixture(scope="module")
def static_run(runs):
    """(exit code, output, report.json, report.md) of `--only static`: every kernel compiled for an H100 here."""
    return finished(runs, "static", timeout=900)[:4]


def test_static_every_gemm_kernel_is_pipelined_on_tensor_cores_under_both_tritons(static_run):
    """Every GEMM kernel of the bench's layer steps (and an mlp and a biased clamped glu), the router's
    three float32 GEMMs (tf32x3) included, at the config an H100 runs, compiled for sm_90a by the
    installed triton and by the lent GPU machine's (tritons.py): HGMMA (wgmma) in its machine code, no
    spilled registers, at least three shared-memory buffers, a main-loop cp.async wait above 0 (the next
    tiles' copies in flight during the MMA) and the column tile on program axis 0."""
    from shardmoe.tools.gpu_check import tritons

    code, output, report, md = static_run
    entry = report["stages"]["static"]
    if entry["status"] == "skipped":
        pytest.skip(f"static stage skipped: {entry['note']}")
    assert code == 0 and entry["status"] == "ok", output + str(entry["result"].get("problems"))
    result = entry["result"]
    assert set(result["tritons"]) == set(tritons.VERSIONS) and not result["skipped_tritons"], result["skipped_tritons"]
    rows = result["kernels"]
    for version in tritons.VERSIONS:
        mine = [r for r in rows if r["triton"] == version]
        assert set(compiled_gemms()) <= {r["name"] for r in mine} and "router_gemm_kernel" in compiled_gemms()
        assert {w.name for w in static.WORKLOADS} == {w for r in mine for w in r["workloads"]}
    for r in rows:
        assert {"name", "triton", "config", "registers", "spill_bytes", "shared_bytes", "mma_instructions",
                "tma_instructions", "async_buffers", "async_wait", "wgmma", "wgmma_wait", "tma_loads", "tma_stores",
                "column_axis"} <= set(r), r
        assert 0 < r["registers"] <= 255 and r["shared_bytes"] >= 0 and "num_warps" in r["config"], r
        if r["gemm"]:
            assert r["mma_instructions"] > 0 and r["spill_bytes"] == 0 and r["wgmma"].startswith("m64n"), r
            assert r["async_buffers"] >= static.MIN_BUFFERS and r["async_wait"] > 0 and r["column_axis"] == 0, r
            assert r["program_axes"][0] == 0, r
        else:
            assert r["mma_instructions"] == 0 and r["wgmma"] is None, r
    assert ("| kernel | triton | config | variant | workloads | registers | spill bytes | shared bytes | HGMMA | HMMA "
            "| wgmma | buffers | cp.async wait | wgmma wait | TMA loads | TMA stores | column axis |") in md


def compiled_gemms():
    from shardmoe.tools.gpu_check.compiled import GEMM_KERNELS

    return GEMM_KERNELS


def test_static_problems_name_what_a_gemm_kernel_lacks():
    row = {"name": "weight_grad_kernel", "triton": "3.6.0", "config": {"BLOCK_O": 128}, "workloads": ["w"],
           "gemm": True, "registers": 255, "spill_bytes": 64, "mma_instructions": 0, "mma_sync_instructions": 2,
           "async_buffers": 2, "async_wait": 0, "tma_loads": 0, "column_axis": 1, "program_axes": [0, 1]}
    found = static.problems({"tritons": ["3.6.0"], "kernels": [row]})
    where = "weight_grad_kernel {'BLOCK_O': 128} (triton 3.6.0; w)"
    assert found == ["triton 3.6.0: GEMM kernels not compiled: down_grad_kernel, forward_gemm_kernel, grad_gemm_kernel, "
                     "router_gemm_kernel",
                     f"{where}: expected tensor-core MMA (HGMMA), got none (2 HMMA)",
                     f"{where}: expected no spills, got 64 bytes (255 registers)",
                     f"{where}: expected at least 3 shared-memory buffers, got 2",
                     f"{where}: expected a main-loop cp.async wait above 0 (or TMA loads), got 0",
                     f"{where}: expected the column tile on program axis 0 (walked fastest), got 1"]
    fed_by_tma = dict(row, spill_bytes=0, mma_instructions=4, async_buffers=3, async_wait=None, tma_loads=2,
                      column_axis=0, program_axes=[0])
    assert static.row_problems(fed_by_tma) == []
    assert static.row_problems(dict(fed_by_tma, tma_loads=0))[0].endswith("(or TMA loads), got None")


def test_pipeline_reads_the_main_loop_of_a_ttgir_module():
    """compiled.pipeline on a hand-written TTGIR outline: the buffers of the [buffers, rows, columns]
    allocations, the waits of the innermost loop holding the MMA (not those after it or of an outer
    loop), and the program axes."""
    from shardmoe.tools.gpu_check import compiled

    ttgir = "\n".join([
        "%0 = tt.get_program_id x : i32",
        "%a = ttg.local_alloc : () -> !ttg.memdesc<3x128x64xbf16, #shared, #smem, mutable>",
        "%b = ttg.local_alloc : () -> !ttg.memdesc<4x64x256xbf16, #shared, #smem, mutable>",
        "%i = ttg.local_alloc : () -> !ttg.memdesc<1x64xi64, #shared, #smem, mutable>",
        "scf.for %t = %0 to %1 step %2 : i32 {",
        "  %w0 = ttg.async_wait %x {num = 0 : i32}",
        "  %r:2 = scf.for %k = %3 to %4 step %5 iter_args(%acc = %c) -> (tensor<128x256xf32>) {",
        "    %w1 = ttg.async_wait %a0, %b0 {num = 2 : i32}",
        "    scf.if %p {",
        "      %w2 = ttg.async_wait %a1 {num = 1 : i32}",
        "    } else {",
        "    }",
        "    %d = ttng.warp_group_dot %a2, %b2, %acc {inputPrecision = 0 : i32, isAsync = true}",
        "    %dw = ttng.warp_group_dot_wait %d {pendings = 1 : i32}",
        "    scf.yield %dw",
        "  } loc(#loc1)",
        "  %w3 = ttg.async_wait {num = 0 : i32}",
        "} loc(#loc2)",
    ])
    assert compiled.pipeline(ttgir) == {"async_buffers": 3, "async_wait": 1, "wgmma_wait": 1, "program_axes": [0]}
    assert compiled.wgmma_shapes("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 ...\n"
                                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16") == "m64n16k16,m64n256k16"


@pytest.fixture(scope="module")
def bench_check_inputs():
    """(shape, the bench's output gradient) at the dry run's fine shape, on the CPU."""
    s = bench.DRY_RUN_SHAPES["fine"]
    gen = torch.Generator().manual_seed(11)
    return s, (torch.randn(1, s.tokens, s.hidden, generator=gen) / s.hidden ** 0.5).to(torch.bfloat16)


def bench_check(s, grad):
    cands, x, notes = bench.build(s, torch.bfloat16, "cpu")
    return notes, bench.check(bench.with_variants(cands), x, bench.contexts(), grad, False)


@pytest.mark.parametrize("name, value", [("shardmoe", 5e-2), ("shardmoe", float("nan")), ("shardmoe:torch", 5e-2),
                                         ("transformers", 5e-2)])
def test_a_wrong_bench_output_fails_the_check_unless_it_is_grouped_mm(monkeypatch, bench_check_inputs, name, value):
    """An output off by `value` relative (or NaN) against float64 fails the stage for shardmoe's own
    paths; grouped_mm's error is reported only (transformers' block runs in bf16)."""
    real, calls = bench.check_step, []
    order = ["transformers", "shardmoe", "shardmoe:torch"]  # the check's order; dense: no forward

    def corrupted(c, context, grad):
        result = real(c, context, grad)
        calls.append(c.name)  # the layer variants step the shardmoe candidate in their own contexts
        if order[len(calls) - 1] == name:
            y = result["y"]
            result["y"] = y * (1 + value) if value == value else torch.full_like(y, value)
        return result

    monkeypatch.setattr(bench, "check_step", corrupted)
    _, (float64, errors, problems) = bench_check(*bench_check_inputs)
    assert calls == ["transformers", "shardmoe", "shardmoe"]
    shown = bench.NAMES.get(name, name)
    assert float64[shown]["y"] > bench.CHECK_TOL if value == value else float64[shown]["y"] == math.inf
    assert all(err < bench.CHECK_TOL for other, errs in float64.items() if other != shown
               for key, err in errs.items()), float64
    if name == "transformers":
        assert not problems and errors["shardmoe vs shardmoe:torch"] < bench.CHECK_TOL
    else:
        assert problems[0].startswith(f"{name}: y error vs float64 "), problems
        assert any(p.startswith("shardmoe vs shardmoe:torch: error ") for p in problems), problems


def test_bench_check_without_transformers_has_a_float64_truth(monkeypatch, bench_check_inputs):
    """build's fallback (transformers' block not built): the layer candidate is checked against float64 too."""
    from shardmoe.tools.bench import candidates

    def broken(*args, **kwargs):
        raise ImportError("no transformers here")

    monkeypatch.setattr(candidates, "build_candidates", broken)
    notes, (float64, errors, problems) = bench_check(*bench_check_inputs)
    assert notes == ["grouped_mm left out: transformers' block could not be built (ImportError: no transformers here)"]
    assert set(float64) == set(bench.CHECKED)
    assert list(errors) == ["shardmoe vs shardmoe:torch"]
    assert all(0 < err < bench.CHECK_TOL for errs in float64.values() for err in errs.values()), float64
    assert not problems


def test_calibrate_writes_constants_the_simulator_reads(dry_run):
    from shardmoe.simulate.presets import resolve

    result = dry_run[2]["stages"]["calibrate"]["result"]
    toml = dry_run[4] / result["toml"]
    assert tomllib.loads(toml.read_text())["hardware"]["gemm_efficiency"] == 1.0
    hardware, _ = resolve("h100", "mixtral-8x7b", str(toml))
    assert hardware.peak_flops == result["calibrated"]["peak_flops"] > 0
    assert hardware.hbm_bandwidth == result["rates"]["copy_bandwidth"] > 0
    assert [p["shape_name"] for p in result["predictions"]] == list(bench.DRY_RUN_SHAPES)
    assert all(p["calibrated_ms"] > 0 and p["shardmoe_ms"] > 0 for p in result["predictions"])


def test_report_markdown_has_every_stage_section_and_table(dry_run):
    md = dry_run[3]
    for name, status in (("env", "ok"), ("static", "skipped"), ("traffic", "ok"), ("tests", "ok"),
                         ("sanitizer", "skipped"), ("parity", "ok"), ("train", "ok"), ("bench", "ok"), ("sweep", "ok"),
                         ("model", "ok"), ("calibrate", "ok")):
        assert f"## {name}: {status}" in md
    assert "| glu-deepseek-router | bfloat16 | 3 | triton |" in md
    assert "SonicMoE, published (H100, S=24576 H=1536 F=256 E=128 k=8): forward 365, backward 405 TFLOP/s" in md
    assert "| shardmoe:torch |" in md and "| peak_flops |" in md
    assert "| candidate | y | x | router | gate_up | down | bound |" in md
    assert ("grouped_mm's errors are reported, not checked: transformers' block runs its router and experts in "
            "bf16.") in md


@pytest.mark.parametrize("argv, message", [
    (["--out", "{tmp}", "--only", "parity,bogus"],
     "--only: expected comma-separated stage names among env, static, traffic, tests, sanitizer, parity, train, "
     "bench, sweep, model, calibrate (or lease), got 'bogus' in 'parity,bogus'"),
    (["--only", "parity"], "--out: expected a directory for report.md and report.json, got None"),
    (["--out", "{tmp}", "--budget", "0"], "--budget: expected a number >= 1, got 0.0"),
    (["--out", "{tmp}", "--merge", "{tmp}/missing.json"], "--merge: expected a report.json written by"),
])
def test_argument_errors_name_the_argument_expected_and_actual(tmp_path, capsys, argv, message):
    assert gpu_check.main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()



def test_a_full_run_without_cuda_is_refused(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: a full run is valid here")
    assert gpu_check.main(["--out", str(tmp_path), "--only", "parity"]) == 2
    assert ("--dry-run: expected it on a machine without CUDA (torch.cuda.is_available() is False), got a full run "
            "of env,parity (only env, static, traffic run without it)") in capsys.readouterr().err


def test_only_runs_env_first_and_stages_in_their_order():
    assert gpu_check.parse_only("bench,parity", merging=False) == ["env", "parity", "bench"]
    # the lease's own priority order, whatever else is named with it
    assert gpu_check.parse_only("lease", merging=False) == ["env", *gpu_check.LEASE]
    assert gpu_check.parse_only("tests,lease", merging=False) == ["env", *gpu_check.LEASE, "tests"]
    lease = gpu_check.LEASE
    assert lease.index("parity") == 0 and lease.index("bench") < lease.index("calibrate")
    assert set(lease) == set(gpu_check.LEASE_SHARES) == set(gpu_check.STAGE_NAMES) - {"env", "tests", "sanitizer"}
    assert gpu_check.parse_only(None, merging=False) == list(gpu_check.STAGE_NAMES)
    assert gpu_check.parse_only(None, merging=True) == []
    assert tuple(runner.STAGES) == gpu_check.STAGE_NAMES


def test_a_failing_stage_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    def broken(ctx):
        ctx.progress({"done": 1})
        raise RuntimeError("stage broke")

    fake = {"env": types.SimpleNamespace(run=broken, markdown=lambda r: ["partial"]),
            "parity": types.SimpleNamespace(run=lambda ctx: {"passed": False, "rows": []}, markdown=lambda r: []),
            "bench": types.SimpleNamespace(run=lambda ctx: {"cases": [1]}, markdown=lambda r: [f"cases {r['cases']}"])}
    monkeypatch.setattr(runner, "STAGES", fake)
    monkeypatch.setattr(runner, "MARKDOWN", {n: m.markdown for n, m in fake.items()})
    assert runner.run(tmp_path, ["env", "parity", "bench"], True, None, [], ["test"]) == 1
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert stages["env"]["status"] == "failed" and "RuntimeError: stage broke" in stages["env"]["error"]
    assert stages["env"]["result"] == {"done": 1}  # the progress it reported before it raised
    assert stages["parity"]["status"] == "failed" and stages["bench"]["status"] == "ok"
    md = (tmp_path / "report.md").read_text()
    assert "## env: failed" in md and "partial" in md and "cases [1]" in md


def test_a_stage_share_cuts_its_cases_and_leaves_the_rest_to_the_next(tmp_path, monkeypatch, capsys):
    """Each stage stops starting cases at its share (or the budget), and the runner runs the stages in
    the order given; a stage the budget leaves unstarted is listed as such."""
    clock = [0.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])

    def cases(ctx):  # one simulated second a case, until the stage's deadline
        done = 0
        while not ctx.out_of_time() and done < 100:
            clock[0] += 1.0
            done += 1
        return {"cases": done}

    fake = {name: types.SimpleNamespace(run=cases, markdown=lambda r: []) for name in ("env", "bench", "parity", "sweep")}
    monkeypatch.setattr(runner, "STAGES", fake)
    monkeypatch.setattr(runner, "MARKDOWN", {n: m.markdown for n, m in fake.items()})
    runner.run(tmp_path, ["env", "bench", "parity", "sweep"], True, 25, [], ["test"], {"bench": 10, "parity": 30})
    assert "gpu_check: env, bench (10 s), parity (30 s), sweep; budget 25 s" in capsys.readouterr().out
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert list(stages) == ["env", "bench", "parity", "sweep"]
    # env has no share: the budget's 25 s; bench its 10; parity the budget's remaining 0 -> not started
    assert stages["env"]["result"] == {"cases": 25}
    assert stages["bench"]["status"] == "skipped" and stages["parity"]["status"] == "skipped"
    clock[0] = 0.0
    runner.run(tmp_path, ["env", "bench", "parity", "sweep"], True, 100, [], ["test"], {"env": 5, "bench": 10,
                                                                                        "parity": 30})
    stages = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert [stages[n]["result"]["cases"] for n in ("env", "bench", "parity", "sweep")] == [5, 10, 30, 55]


def test_merge_combines_earlier_reports_without_running_stages(dry_run, tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--merge", str(dry_run[4] / "report.json")]) == 0
    merged = json.loads((tmp_path / "report.json").read_text())
    assert merged["stages"] == dry_run[2]["stages"] and merged["runs"] == dry_run[2]["runs"]
    assert "## parity: ok" in (tmp_path / "report.md").read_text()


def test_tests_stage_on_cuda_runs_every_kernel_file_compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    todo = pytest_stage.groups(ROOT, dry_run=False)
    kernel_files = sorted(p.stem for p in (ROOT / "tests" / "kernels").glob("test_*.py"))
    assert [name for name, _ in todo] == kernel_files + ["moe"]
    assert dict(todo)["moe"] and all((ROOT / path).exists() for _, paths in todo for path in paths)
    env = pytest_stage.environment(ROOT, dry_run=False)
    assert env["SHARDMOE_TEST_COMPILED"] == "1" and "TRITON_INTERPRET" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_junit_counts_and_failures_are_parsed(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.kernels.test_forward" name="test_a"/>'
                   '<testcase classname="tests.kernels.test_forward" name="test_b">'
                   '<failure message="AssertionError: 0.5 &lt; 1e-05">long traceback</failure></testcase>'
                   '<testcase classname="tests.kernels.test_layer_path" name="test_c">'
                   '<skipped message="compiled mode: CPU tensors"/></testcase></testsuite></testsuites>')
    parsed = pytest_stage.parse_junit(xml)
    assert (parsed["tests"], parsed["passed"], parsed["failures"], parsed["skipped"]) == (3, 1, 1, 1)
    assert parsed["failing"] == [{"test": "tests.kernels.test_forward::test_b", "kind": "failure",
                                  "message": "AssertionError: 0.5 < 1e-05"}]
    assert parsed["skip_reasons"] == ["compiled mode: CPU tensors"]


def test_sanitizer_summaries_are_parsed():
    memcheck = "========= COMPUTE-SANITIZER\n========= Invalid __global__ read of size 2 bytes\n" \
               "=========     at forward_gemm_kernel+0x1a0\n========= ERROR SUMMARY: 3 errors\n"
    racecheck = "========= COMPUTE-SANITIZER\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert sanitizer.summary_errors(memcheck) == 3
    assert sanitizer.summary_errors(racecheck) == 0
    assert sanitizer.summary_errors("no summary") is None
    assert sanitizer.error_lines(memcheck) == ["========= Invalid __global__ read of size 2 bytes",
                                               "=========     at forward_gemm_kernel+0x1a0"]


@pytest.mark.parametrize("errors", [0, 2])
def test_sanitizer_stage_runs_the_workload_plain_then_under_each_tool(tmp_path, monkeypatch, errors):
    """The CUDA flow with stand-ins: a workload that prints whether the caching allocator is off, and
    a compute-sanitizer on PATH that runs it and prints a summary with `errors` errors."""
    tools = tmp_path / "bin"
    tools.mkdir()
    fake = tools / "compute-sanitizer"
    fake.write_text("#!/bin/sh\nwhile [ \"${1#--}\" != \"$1\" ]; do shift 2; done\n\"$@\"\n"
                    f"[ {errors} -gt 0 ] && echo '========= Invalid __global__ write of size 4 bytes'\n"
                    f"echo '========= ERROR SUMMARY: {errors} errors'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sanitizer, "WORKLOAD", ["-c", "import os; print('caching', os.environ.get("
                                                      "'PYTORCH_NO_CUDA_MEMORY_CACHING', 'on')); "
                                                      f"print({sanitize.DONE_LINE!r})"])
    report = runner.Report(tmp_path, {"started": "now", "host": "test", "device": "cuda", "dry_run": False,
                                      "argv": ["test"]})
    ctx = runner.Context(tmp_path, False, "cuda", ROOT, None, report, "sanitizer")
    result = sanitizer.run(ctx)
    assert result["plain"]["completed"] and result["plain"]["returncode"] == 0
    assert "caching on" in (tmp_path / "sanitizer-plain.log").read_text()
    assert [t["tool"] for t in result["tools"]] == ["memcheck", "racecheck"]
    for t in result["tools"]:
        assert t["completed"] and t["returncode"] == 0 and t["errors"] == errors
        assert "caching 1" in (tmp_path / t["log"]).read_text()
        assert t["first_errors"] == (["========= Invalid __global__ write of size 4 bytes"] if errors else [])
    assert result["passed"] is (errors == 0)


@pytest.mark.parametrize("value, message", [
    ("2", "SHARDMOE_TEST_COMPILED: expected 0 (interpreter) or 1 (compiled on CUDA), got '2'"),
    ("1", "SHARDMOE_TEST_COMPILED=1: expected a CUDA device (torch.cuda.is_available()), got none"),
])
def test_compiled_switch_of_the_kernel_tests_refuses_what_it_cannot_do(value, message):
    if value == "1" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present: compiled mode is valid here")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only",
                           "tests/kernels/test_kernel_path.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(ENV, SHARDMOE_TEST_COMPILED=value))
    assert done.returncode == 4, done.stdout + done.stderr
    assert message in done.stdout + done.stderr
