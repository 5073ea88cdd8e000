"""Stage calibrate: the simulator's hardware constants (shardmoe/simulate/presets.py: Hardware)
from what this device measured, as shardmoe/simulate/calibrate.py does on CPU ranks.

  peak_flops       the dense candidate's TFLOP/s at the bench's largest-FLOP shape, gemm_efficiency 1
                   (as calibrate.py: the model's GEMM rate is peak * efficiency, and this is it)
  hbm_bandwidth    a device copy's bytes moved (read + write) per second; the layer's SiLU GLU pass
                   (calibrate.py's elementwise probe) is measured beside it
  kernel_launch    host seconds per launch of a tiny op, in a loop of LAUNCHES
  host_sync        one tiny op then its result read by the host (.item()), the median of SYNCS
  sms              the device's SM count (CUDA)
The bench's shardmoe step times come from the bench stage (this run's, or a report merged in).
Then the model's one-GPU step (simulate.calibrate.predict: the bulk-synchronous baseline, no
exchange) is predicted with the preset and with the calibrated constants, against the measured
steps of both paths. DIR/calibrated.toml holds the constants for
`shardmoe simulate --config DIR/calibrated.toml`.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

from .report import fmt, table

LAUNCHES = 200
SYNCS = 50
COPY_BYTES = 1 << 30  # per copy direction on CUDA: far beyond L2
DRY_RUN_COPY_BYTES = 1 << 22


def _sync(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def _median_ms(fn, cuda: bool, repeats: int = 7) -> float:
    from .bench import Clock

    clock = Clock(cuda)
    fn()
    times = []
    for _ in range(repeats):
        _sync(cuda)
        start = clock.mark()
        fn()
        end = clock.mark()
        _sync(cuda)
        times.append(clock.ms(start, end))
    return statistics.median(times)


def measure_rates(device: str, dry_run: bool, glu_rows: int, glu_ffn: int) -> dict:
    """Copy and SiLU GLU bytes/s, launch and host-read seconds on `device`."""
    import torch

    from shardmoe.moe.cpu import CpuOps, Workspace
    from shardmoe.moe.experts import TORCH_OPS, glu_activation
    from shardmoe.simulate.calibrate import glu_pass_bytes

    cuda = device == "cuda"
    n = (DRY_RUN_COPY_BYTES if dry_run else COPY_BYTES) // 2
    a, b = torch.empty(n, device=device, dtype=torch.bfloat16), torch.empty(n, device=device, dtype=torch.bfloat16)
    copy_ms = _median_ms(lambda: b.copy_(a), cuda)
    h = torch.randn(glu_rows, 2 * glu_ffn, device=device).to(torch.bfloat16)
    ops = TORCH_OPS if cuda else CpuOps.decide(h, Workspace())  # what the torch backend runs there
    glu_ms = _median_ms(lambda: glu_activation(ops, h, "silu"), cuda)
    tiny = torch.zeros(1, device=device)

    def launches():
        for _ in range(LAUNCHES):
            tiny.add_(1)

    _sync(cuda)
    start = time.perf_counter()
    launches()
    _sync(cuda)
    launch = (time.perf_counter() - start) / LAUNCHES
    reads = []
    for _ in range(SYNCS):
        _sync(cuda)
        start = time.perf_counter()
        tiny.add_(1)
        tiny.item()
        reads.append(time.perf_counter() - start)
    return {"copy_bandwidth": 2 * a.numel() * a.element_size() / (copy_ms / 1e3),
            # counted as the simulator's own calibration counts the pass
            "glu_bandwidth": glu_pass_bytes(h) / (glu_ms / 1e3),
            "glu_shape": [glu_rows, 2 * glu_ffn], "kernel_launch": launch, "host_sync": statistics.median(reads)}


def toml_text(hardware, device_name: str) -> str:
    fields = ("peak_flops", "gemm_efficiency", "hbm_bandwidth", "sms", "kernel_launch", "host_sync",
              "bytes_per_element", "tile_rows")
    lines = [f"# measured by python -m shardmoe.tools.gpu_check on {device_name}; "
             "shardmoe simulate --config THIS_FILE (shardmoe/simulate/presets.py: Hardware)", "[hardware]"]
    return "\n".join(lines + [f"{name} = {getattr(hardware, name)!r}" for name in fields]) + "\n"


def run(ctx) -> dict:
    import torch

    from shardmoe.simulate.calibrate import predict
    from shardmoe.simulate.presets import Hardware, ModelShape

    bench = ctx.report.result("bench")
    cases = (bench or {}).get("cases") or []
    if not cases:
        raise ValueError("calibrate: expected the bench stage's results (run --only bench,calibrate, or --merge a "
                         "report that has them), got none")
    largest = max(cases, key=lambda c: c["flops"])
    rows = {c["shape_name"]: {r["candidate"]: r for r in c["rows"]} for c in cases}
    dense = rows[largest["shape_name"]]["dense"]["tflops"] * 1e12
    shape = largest["shape"]
    rates = measure_rates(ctx.device, ctx.dry_run, shape["tokens"] * shape["top_k"], shape["ffn"])
    cuda = ctx.device == "cuda"
    name = torch.cuda.get_device_name(0) if cuda else "CPU (dry run)"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else Hardware().sms
    calibrated = dataclasses.replace(Hardware(), peak_flops=dense, gemm_efficiency=1.0,
                                     hbm_bandwidth=rates["copy_bandwidth"], sms=sms,
                                     kernel_launch=rates["kernel_launch"], host_sync=rates["host_sync"])
    predictions = []
    for c in cases:
        s = c["shape"]
        model = ModelShape(s["hidden"], s["ffn"], s["experts"], s["top_k"], tokens_per_gpu=s["tokens"])
        measured = rows[c["shape_name"]]
        predictions.append({"shape_name": c["shape_name"], "preset_ms": predict(model, Hardware(), 1) * 1e3,
                            "calibrated_ms": predict(model, calibrated, 1) * 1e3,
                            "shardmoe_ms": measured["shardmoe"]["median_ms"],
                            "torch_path_ms": measured["shardmoe:torch"]["median_ms"]})
    toml = ctx.out / "calibrated.toml"
    toml.write_text(toml_text(calibrated, name))
    preset = Hardware()
    return {"device": name, "rates": rates, "dense_shape": largest["shape_name"],
            "preset": dataclasses.asdict(preset), "calibrated": dataclasses.asdict(calibrated),
            "preset_gemm_rate": preset.peak_flops * preset.gemm_efficiency, "predictions": predictions,
            "toml": toml.name}


def markdown(result: dict) -> list[str]:
    preset, calibrated, rates = result["preset"], result["calibrated"], result["rates"]
    keys = ("peak_flops", "gemm_efficiency", "hbm_bandwidth", "sms", "kernel_launch", "host_sync")
    lines = [f"Device: {result['device']}. GEMM rate from the dense candidate at the {result['dense_shape']} shape; "
             f"the preset's peak x efficiency is {result['preset_gemm_rate'] / 1e12:.0f} TFLOP/s. Copy "
             f"{rates['copy_bandwidth'] / 1e9:.0f} GB/s, SiLU GLU pass {rates['glu_bandwidth'] / 1e9:.0f} GB/s "
             f"on h {rates['glu_shape']}. Written to {result['toml']} "
             f"(`shardmoe simulate --config {result['toml']}`).", ""]
    lines += table(["constant", "preset (h100)", "calibrated"], [[k, f"{preset[k]:.4g}", f"{calibrated[k]:.4g}"]
                                                                 for k in keys])
    lines += ["", "One MoE layer, forward + backward, one GPU (simulate's bulk-synchronous baseline):", ""]
    lines += table(["shape", "predicted, preset (ms)", "predicted, calibrated (ms)", "measured shardmoe (ms)",
                    "measured torch path (ms)", "calibrated / shardmoe"],
                   [[p["shape_name"], fmt(p["preset_ms"], ".3f"), fmt(p["calibrated_ms"], ".3f"),
                     fmt(p["shardmoe_ms"], ".3f"), fmt(p["torch_path_ms"], ".3f"),
                     fmt(p["calibrated_ms"] / p["shardmoe_ms"], ".2f")] for p in result["predictions"]])
    return lines
