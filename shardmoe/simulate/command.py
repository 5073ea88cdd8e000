"""`shardmoe simulate`: one MoE layer's forward + backward at several GPU counts, the tile-task
schedule (FlashMoE's, run by shardmoe.tasks without tensors under the cost model) against the
bulk-synchronous baseline. Prints the model and hardware it simulates, a progress bar (stderr)
and a table; with --out DIR it also writes DIR/simulate.json and DIR/simulate.png.

    shardmoe simulate --preset deepseek-v3 --gpus 8,64,512,1024
    shardmoe simulate --preset mixtral-8x7b --routing zipf:1.2 --set fabric_bandwidth=25e9
    shardmoe simulate --config cluster.toml --routing replay:runs/default/metrics.jsonl --out runs/simulate
    shardmoe simulate --preset deepseek-v3 --gpus 1024 --pipeline   # + every (p, e, d) layout and schedule

GPU counts whose expert-parallel group is the same (min(gpus, E)) are simulated once (their
data-parallel copies are identical within the layer: sweep.py). With --pipeline, each GPU count's
layouts of p pipeline stages x e expert-parallel x d data-parallel ranks are priced under each
pipeline schedule with the model's layers (shardmoe/simulate/pipeline.py), the layer simulated at
every e a layout uses, and the fastest layout that fits a GPU's memory is named.
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
    parser.add_argument("--pipeline", action="store_true",
                        help="also price every (p, e, d) layout of each GPU count under the pipeline schedules "
                             "(gpipe, 1f1b, interleaved-1f1b) and name the fastest that fits (pipeline.py)")
    parser.add_argument("--stages-per-rank", type=int, default=2, metavar="V",
                        help="the interleaved-1f1b schedule's stages per rank (default 2)")
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


def simulate_sizes(eps: list[int], shape, hardware, routing: str, seed: int, known: dict[int, dict] | None = None,
                   desc: str = "simulating", progress: bool = False) -> dict[int, dict]:
    """e -> the one-layer simulation at e GPUs (one expert-parallel group: sweep.simulate_point),
    for each distinct e of `eps` in their order; an e in `known` (e -> an earlier simulation of it)
    is taken from there, not simulated again."""
    from tqdm import tqdm

    from .sweep import simulate_point
    known = known or {}
    distinct = list(dict.fromkeys(eps))
    out = {ep: known[ep] for ep in distinct if ep in known}
    with tqdm(total=len(distinct) - len(out), desc=desc, unit="EP size", disable=not progress) as bar:
        for ep in distinct:
            if ep not in out:
                bar.set_postfix(ep=ep)
                out[ep] = simulate_point(ep, shape, hardware, routing, seed)
                bar.update(1)
    return out


def sweep(counts: list[int], shape, hardware, routing: str, seed: int, progress: bool = False) -> list[dict]:
    """One row per GPU count: the layer simulated at its expert-parallel group, e = min(gpus, E)
    (once per distinct e), with its GPU count and data-parallel replicas."""
    from .sweep import layout
    eps = [layout(gpus, shape, hardware)["ep"] for gpus in counts]  # every count checked before any work
    layer = simulate_sizes(eps, shape, hardware, routing, seed, progress=progress)
    return [dict(layer[ep], gpus=gpus, replicas=gpus // ep) for gpus, ep in zip(counts, eps)]


def describe(preset: str, shape, hardware_name: str, hardware, routing: str) -> str:
    """One line naming the simulated layer and machine, with the values in force (--set included)."""
    return (f"simulating one MoE layer, forward + backward: {preset} (H {shape.hidden_size}, F {shape.ffn_size}, "
            f"E {shape.num_experts}, top-{shape.top_k}, {shape.tokens_per_gpu} tokens per GPU), {routing} routing, "
            f"on {hardware_name} GPUs ({hardware.peak_flops / 1e12:g} TFLOP/s peak x {hardware.gemm_efficiency:g}, "
            f"HBM {hardware.hbm_bandwidth / 1e12:g} TB/s, NVLink {hardware.nvlink_bandwidth / 1e9:g} GB/s, fabric "
            f"{hardware.fabric_bandwidth / 1e9:g} GB/s per GPU, {hardware.gpus_per_node} per node)")


def pipeline_report(counts: list[int], shape, hardware, routing: str, seed: int, stages_per_rank: int,
                    known: dict[int, dict] | None = None, progress: bool = False) -> dict[int, list[dict]]:
    """GPU count -> every layout and schedule priced (pipeline.sweep_layouts), fastest first; the
    layer at each e a layout uses is simulated once, unless `known` (e -> its simulation) has it."""
    from .pipeline import layouts, sweep_layouts

    eps = sorted({layout.e for gpus in counts for layout in layouts(gpus, shape)})
    layer = simulate_sizes(eps, shape, hardware, routing, seed, known, desc="simulating layers", progress=progress)
    return {gpus: sweep_layouts(gpus, shape, hardware, layer, stages_per_rank) for gpus in counts}


def format_pipeline(gpus: int, rows: list[dict], memory_bytes: float, shown: int = 12) -> str:
    """The fastest `shown` layouts that fit, one line per (p, e, d) with each schedule's step and
    bubble, and a line naming the fastest."""
    from shardmoe.parallel.pipeline import SCHEDULES

    from .pipeline import fastest

    best: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["fits"]:
            best.setdefault((r["p"], r["e"], r["d"]), {})[r["schedule"]] = r
    head = f"{'p':>3} {'e':>4} {'d':>4} {'m':>5} {'GB':>4}" + "".join(f" {n:>16} {'bubble':>6}" for n in SCHEDULES) + \
        f" {'bulk s':>8}"
    lines = [f"pipeline layouts of {gpus} GPUs that fit (p stages x e expert-parallel x d data-parallel, m "
             "micro-batches per step, GB per GPU under its leanest schedule): step seconds per schedule with the "
             "tile schedule's layer, the bulk-synchronous layer's under the best schedule", head]
    for (p, e, d), by_schedule in list(best.items())[:shown]:
        line = f"{p:>3} {e:>4} {d:>4} {next(iter(by_schedule.values()))['microbatches']:>5} " \
               f"{min(r['memory_bytes'] for r in by_schedule.values()) / 1e9:>4.0f}"
        for name in SCHEDULES:
            r = by_schedule.get(name)
            line += f" {'-':>16} {'-':>6}" if r is None else f" {r['step_seconds']:>16.3f} {100 * r['bubble']:>5.1f}%"
        lines.append(line + f" {min(r['bulk_step_seconds'] for r in by_schedule.values()):>8.3f}")
    top = fastest(rows)
    if top is None:
        least = min((r["memory_bytes"] for r in rows), default=0.0)
        lines.append(f"no layout of {gpus} GPUs fits a GPU's {memory_bytes / 1e9:.0f} GB (the smallest needs "
                     f"{least / 1e9:.0f} GB)")
    else:
        lines.append(f"fastest at {gpus} GPUs: p={top['p']}, e={top['e']}, d={top['d']} with {top['schedule']} "
                     f"({top['microbatches']} micro-batches): {top['step_seconds']:.3f} s per step, bubble "
                     f"{100 * top['bubble']:.1f}%, {top['tokens_per_s'] / 1e6:.2f} M tokens/s, "
                     f"{top['memory_bytes'] / 1e9:.0f} GB per GPU")
    return "\n".join(lines)


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
    if args.pipeline:
        from shardmoe.arguments import check_at_least

        from .pipeline import layouts
        check_at_least("--stages-per-rank", args.stages_per_rank, 2)
        for gpus in counts:
            if not layouts(gpus, shape):
                raise ValueError(f"--gpus {gpus}: no pipeline layout (p * e * d = {gpus}, e dividing E = "
                                 f"{shape.num_experts}, p at most layers = {shape.layers}) splits batch_tokens = "
                                 f"{shape.batch_tokens} into whole micro-batches of tokens_per_gpu = "
                                 f"{shape.tokens_per_gpu} tokens")
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
    layouts = None
    if args.pipeline:
        layouts = pipeline_report(counts, shape, hardware, args.routing, args.seed, args.stages_per_rank,
                                  known={r["ep"]: r for r in rows}, progress=True)
        for gpus in counts:
            print(format_pipeline(gpus, layouts[gpus], hardware.memory_bytes))
    if args.out is None:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"preset": args.preset, "routing": args.routing, "hardware": dataclasses.asdict(hardware),
              "model": dataclasses.asdict(shape), "points": rows}
    if layouts is not None:
        report["pipeline"] = {str(gpus): layouts[gpus] for gpus in counts}
    (out / "simulate.json").write_text(json.dumps(report, indent=1))
    plot(rows, f"{args.preset}, {args.routing} routing, {args.hardware}", out / "simulate.png")
    print(f"wrote {out / 'simulate.json'} and {out / 'simulate.png'}")
    return 0
