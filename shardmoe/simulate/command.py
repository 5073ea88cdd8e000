"""`shardmoe simulate`: one MoE layer's forward + backward at several GPU counts, the tile-task
schedule (FlashMoE's, run by shardmoe.tasks without tensors under the cost model) against the
bulk-synchronous baseline. Prints the model and hardware it simulates, a progress bar (stderr)
and a table; with --out DIR it also writes DIR/simulate.json and DIR/simulate.png.

    shardmoe simulate --preset deepseek-v3 --gpus 8,64,512,1024
    shardmoe simulate --preset mixtral-8x7b --routing zipf:1.2 --set fabric_bandwidth=25e9
    shardmoe simulate --config cluster.toml --routing replay:runs/default/metrics.jsonl --out runs/simulate

GPU counts whose expert-parallel group is the same (min(gpus, E)) are simulated once (their
data-parallel copies are identical within the layer: sweep.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from .presets import HARDWARE, MODELS, resolve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="deepseek-v3", choices=sorted(MODELS), help="the MoE layer's shape")
    parser.add_argument("--hardware", default="h100", choices=sorted(HARDWARE))
    parser.add_argument("--gpus", default="8,16,32,64,128,256,512,1024",
                        help="comma-separated GPU counts (default 8..1024)")
    parser.add_argument("--routing", default="uniform", help="uniform | zipf:EXPONENT | replay:METRICS_JSONL")
    parser.add_argument("--config", default=None, metavar="TOML", help="[hardware] and [model] overrides")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override one hardware or model field (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write simulate.json (every number) and simulate.png there (default: print only)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's GEMM, copy and exchange rates and compare the model's "
                             "predicted 1- and 2-rank expert-parallel step with the measured one (calibrate.py)")


def parse_gpus(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--gpus: expected comma-separated integers, got {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"--gpus: expected positive integers, got {text!r}")
    return counts


def sweep(counts: list[int], shape, hardware, routing: str, seed: int, progress: bool = False) -> list[dict]:
    from tqdm import tqdm

    from .sweep import layout, simulate_point
    eps = [layout(gpus, shape, hardware)["ep"] for gpus in counts]  # every count checked before any work
    simulated: dict[int, dict] = {}
    rows = []
    with tqdm(total=len(set(eps)), desc="simulating", unit="EP size", disable=not progress) as bar:
        for gpus, ep in zip(counts, eps):
            if ep not in simulated:
                bar.set_postfix(gpus=gpus)
                simulated[ep] = simulate_point(gpus, shape, hardware, routing, seed)
                bar.update(1)
            rows.append(dict(simulated[ep], gpus=gpus, replicas=gpus // ep))
    return rows


def describe(preset: str, shape, hardware_name: str, hardware, routing: str) -> str:
    """One line naming the simulated layer and machine, with the values in force (--set included)."""
    return (f"simulating one MoE layer, forward + backward: {preset} (H {shape.hidden_size}, F {shape.ffn_size}, "
            f"E {shape.num_experts}, top-{shape.top_k}, {shape.tokens_per_gpu} tokens per GPU), {routing} routing, "
            f"on {hardware_name} GPUs ({hardware.peak_flops / 1e12:g} TFLOP/s peak x {hardware.gemm_efficiency:g}, "
            f"HBM {hardware.hbm_bandwidth / 1e12:g} TB/s, NVLink {hardware.nvlink_bandwidth / 1e9:g} GB/s, fabric "
            f"{hardware.fabric_bandwidth / 1e9:g} GB/s per GPU, {hardware.gpus_per_node} per node)")


def format_table(rows: list[dict]) -> str:
    head = (f"{'GPUs':>5} {'EP':>4} {'tile ms':>8} {'bulk ms':>8} {'speedup':>7} {'tile %peak':>10} "
            f"{'bulk %peak':>10} {'overlap':>7} {'bound by':>8} {'fabric GB':>9} {'NVLink GB':>9} {'sim s':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['gpus']:>5} {r['ep']:>4} {r['tile_seconds'] * 1e3:>8.2f} {r['bulk_seconds'] * 1e3:>8.2f} "
                     f"{r['speedup']:>6.2f}x {100 * r['tile_fraction_of_peak']:>9.1f}% "
                     f"{100 * r['bulk_fraction_of_peak']:>9.1f}% {100 * r['tile_overlap']:>6.0f}% "
                     f"{r['tile_binding']:>8} {r['link_bytes']['fabric'] / 1e9:>9.1f} "
                     f"{r['link_bytes']['nvlink'] / 1e9:>9.1f} {r['simulated_in_seconds']:>6.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gpus = [r["gpus"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("tile", "tile-task schedule (FlashMoE)"), ("bulk", "bulk-synchronous EP")):
        left.plot(gpus, [r[f"{key}_seconds"] * 1e3 for r in rows], marker="o", label=label)
        right.plot(gpus, [100 * r[f"{key}_fraction_of_peak"] for r in rows], marker="o", label=label)
    for ax, ylabel in ((left, "step time of one MoE layer, fwd+bwd (ms)"), (right, "fraction of peak (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    right.set_ylim(bottom=0)
    left.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_calibration() -> int:
    from .calibrate import SHAPE, calibrate
    r, rows = calibrate()
    print(f"calibration: shardmoe.MoE H={SHAPE.hidden_size} F={SHAPE.ffn_size} E={SHAPE.num_experts} "
          f"k={SHAPE.top_k}, {SHAPE.tokens_per_gpu} tokens per rank, fp32, 1 thread per rank, forward + backward")
    print(f"  measured link: exchange {r['link_bytes_per_s'] / 1e9:.3f} GB/s, "
          f"one-row exchange {r['link_latency_s'] * 1e6:.0f} us")
    for row in rows:
        device = row["rates"]
        together = " (both ranks at once)" if row["ranks"] > 1 else ""
        print(f"  {row['ranks']} rank(s): GEMM {device['peak_flops'] / 1e9:.1f} GFLOP/s, copy "
              f"{device['copy_bandwidth'] / 1e9:.2f} GB/s, elementwise (SiLU GLU) {device['hbm_bandwidth'] / 1e9:.2f} "
              f"GB/s, fixed cost {device['host_overhead'] * 1e3:.1f} ms per rank{together}; predicted "
              f"{row['predicted_s'] * 1e3:.1f} ms, measured {row['measured_s'] * 1e3:.1f} ms, "
              f"predicted / measured {row['ratio']:.2f}")
        predicted = {k: round(v * 1e3, 2) for k, v in row["predicted_phases"].items()}
        print(f"    predicted phases (ms): {predicted}")
        if row["phases"]:
            print(f"    measured phases, rank 0 (ms): { {k: round(v * 1e3, 2) for k, v in row['phases'].items()} }")
    return 0


def check_arguments(args) -> None:
    """Every input error before any work: presets and overrides, GPU counts, routing, --out."""
    from shardmoe.arguments import check_out_dir, check_seed

    from .routing import popularity
    from .sweep import layout

    counts = parse_gpus(args.gpus)
    check_seed("--seed", args.seed)
    if args.calibrate:
        return
    hardware, shape = resolve(args.hardware, args.preset, args.config, args.set)
    for gpus in counts:
        layout(gpus, shape, hardware)
    popularity(args.routing, shape.num_experts)
    if args.out is not None:
        check_out_dir("--out", args.out)


def run(args) -> int:
    if args.calibrate:
        return run_calibration()
    hardware, shape = resolve(args.hardware, args.preset, args.config, args.set)
    counts = parse_gpus(args.gpus)
    print(describe(args.preset, shape, args.hardware, hardware, args.routing), flush=True)
    rows = sweep(counts, shape, hardware, args.routing, args.seed, progress=True)
    print(format_table(rows))
    if args.out is None:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"preset": args.preset, "routing": args.routing, "hardware": dataclasses.asdict(hardware),
              "model": dataclasses.asdict(shape), "points": rows}
    (out / "simulate.json").write_text(json.dumps(report, indent=1))
    plot(rows, f"{args.preset}, {args.routing} routing, {args.hardware}", out / "simulate.png")
    print(f"wrote {out / 'simulate.json'} and {out / 'simulate.png'}")
    return 0
