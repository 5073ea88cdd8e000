"""Stage train: `shardmoe train`'s loop on the device, as a person trains with it.

Every run goes through shardmoe.train.loop.train on the embedded corpus with the byte tokenizer
(tokenized once into DIR/token_cache), no evaluation, samples or health reports:
  default        the default preset (TrainConfig()), fp32, STEPS steps
  mixtral-1gpu   the preset of that name (shardmoe/train/presets.py: d_model 2048, 4 blocks, 8
                 experts of 7168, top-2, 4 rows of 4096 tokens, bf16 autocast), STEPS steps
Each run's tokens/s and MFU are the loop's own (metrics.jsonl's columns: MFU against
shardmoe/train/flops.py peak_flops, the GPU's dense bf16 peak from its datasheet), taken over
the steps after the first logging interval (which holds the compiles and the autotuning) as their
tokens and FLOPs over their time (shardmoe/train/metrics.py throughput); beside
them the peak of torch.cuda.max_memory_allocated over the run and the first and last losses.

Checks (each a problem when it does not hold):
  precision  mixtral-1gpu's first AGREE_STEPS losses against the same run in fp32 on the device,
             within BF16_TOL relative
  cpu        the default run's first AGREE_STEPS losses against the same run on the CPU, within
             CPU_TOL relative (the kernels' fp32 GEMMs may use TF32; other summation orders)
  repeat     the default preset's first RESUME_AT steps run again: bitwise the first run's (a
             device that is not deterministic would make the resume check meaningless)
  resume     that second run stopped at step RESUME_AT (a checkpoint in DIR/train-resume) and
             resumed to STEPS: every later step's loss, gradient norm, learning rate and loads
             bitwise those of the uninterrupted run
  mfu        on a GPU, mixtral-1gpu at MFU >= MFU_TARGET
A run not started because the budget was spent is listed under left_out (a problem too).

--dry-run: the same runs at DRY_RUN sizes on the CPU (both presets' model replaced by a tiny one,
a few steps), no mfu check: it checks that the stage runs and reports.
"""
from __future__ import annotations

import shutil
import time

from .report import fmt, table

STEPS, AGREE_STEPS, RESUME_AT = 50, 5, 25
BF16_TOL, CPU_TOL = 2e-2, 1e-3
MFU_TARGET = 0.30
PRESETS = ("default", "mixtral-1gpu")
# the settings the stage's runs share: no evaluation, samples, health reports or periodic checkpoints
QUIET = {"eval_batches": 0, "sample_tokens": 0, "health_every": 0, "checkpoint_every": 0, "log_every": 10}
# the dry run: both presets' model replaced by a tiny one, a few steps of a few rows
DRY_RUN = {"steps": 3, "agree_steps": 2, "resume_at": 2, "log_every": 1, "batch_size": 2, "seq_len": 32,
           "model": {"d_model": 32, "n_layers": 2, "n_q_heads": 2, "n_kv_heads": 1, "head_dim": 16,
                     "num_experts": 4, "top_k": 2, "ffn_size": 32}}
# the columns a resumed run must reproduce bit for bit (not the wall-clock ones)
EXACT = ("loss", "aux_loss", "lr", "grad_norm", "dropped_tokens", "expert_tokens")


def settings(preset: str, ctx, **changes) -> dict:
    """The TrainConfig.from_dict values of a run of `preset` on ctx's device (DRY_RUN's sizes in a
    dry run), with `changes` over them."""
    values = {"arch": "mixtral" if preset == "default" else preset, **QUIET, "device": ctx.device,
              "token_cache": str(ctx.out / "token_cache"), "steps": STEPS}
    if ctx.dry_run:
        values.update(steps=DRY_RUN["steps"], log_every=DRY_RUN["log_every"], batch_size=DRY_RUN["batch_size"],
                      seq_len=DRY_RUN["seq_len"], model=DRY_RUN["model"])
    return {**values, **changes}


def train_run(values: dict, out=None, **options) -> dict:
    """One run of shardmoe.train.loop.train: its metric rows, peak GiB on a GPU, MFU's peak source."""
    import torch

    from shardmoe.train.config import TrainConfig
    from shardmoe.train.loop import train

    from .bench import free

    config = TrainConfig.from_dict(values)
    cuda = config.device == "cuda"
    if cuda:  # the previous run's model and optimizer are gone: their memory leaves the peak too
        free(cuda)
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = train(config, out, progress=False, **options)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    model = config.model.to_dict()
    return {"rows": result.metrics, "peak_gib": peak, "peak_source": result.peak_source,
            "peak_flops": result.peak_flops, "seconds": seconds, "log_every": config.log_every, "dtype": config.dtype,
            "tokens_per_step": config.batch_size * config.seq_len,
            "model": {k: model[k] for k in ("d_model", "n_layers", "num_experts", "top_k", "ffn_size")}}


def summary(name: str, run: dict) -> dict:
    """A run's report row: its sizes, throughput after the first logging interval, memory, losses."""
    from shardmoe.train.metrics import throughput

    rows = run["rows"]
    tokens_per_s, mfu = throughput([r for r in rows if r["step"] > run["log_every"]] or rows)
    return {"run": name, "dtype": run["dtype"], "steps": len(rows), "tokens_per_step": run["tokens_per_step"],
            "model": run["model"], "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_gib": run["peak_gib"],
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"], "seconds": run["seconds"]}


def agreement(what: str, a: list[dict], b: list[dict], steps: int, tolerance: float) -> dict:
    """The largest relative difference of the first `steps` losses of two runs."""
    diffs = [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a[:steps], b[:steps])]
    worst = max(diffs) if len(diffs) == steps else float("inf")
    return {"check": what, "steps": steps, "max_rel_diff": worst, "tolerance": tolerance, "passed": worst <= tolerance}


def first_difference(a: list[dict], b: list[dict]) -> int | None:
    """The first step at which two runs' EXACT columns differ (None: none, over the steps both have)."""
    for x, y in zip(a, b):
        if any(x[k] != y[k] for k in EXACT):
            return x["step"]
    return None if len(a) == len(b) else min(len(a), len(b)) + 1


def run(ctx) -> dict:
    agree = DRY_RUN["agree_steps"] if ctx.dry_run else AGREE_STEPS
    resume_at = DRY_RUN["resume_at"] if ctx.dry_run else RESUME_AT
    result: dict = {"runs": [], "checks": [], "left_out": [], "dry_run": ctx.dry_run}
    runs: dict[str, dict] = {}

    def timed_run(preset):
        runs[preset] = train_run(settings(preset, ctx))
        result["runs"].append(summary(preset, runs[preset]))
        result.setdefault("peak_source", runs[preset]["peak_source"])

    def precision():
        fp32 = train_run(settings("mixtral-1gpu", ctx, dtype="float32"), stop_after=agree)
        result["checks"].append(agreement(f"mixtral-1gpu: bf16 against fp32 on {ctx.device}", runs["mixtral-1gpu"]["rows"],
                                          fp32["rows"], agree, BF16_TOL))

    def cpu():
        on_cpu = train_run(settings("default", ctx, device="cpu"), stop_after=agree)
        result["checks"].append(agreement(f"default: {ctx.device} against the CPU", runs["default"]["rows"],
                                          on_cpu["rows"], agree, CPU_TOL))

    def resume():
        out = ctx.out / "train-resume"
        shutil.rmtree(out, ignore_errors=True)
        stopped = train_run(settings("default", ctx), out, stop_after=resume_at)
        resumed = train_run(settings("default", ctx), out, resume=True)
        whole = runs["default"]["rows"]
        repeat = first_difference(stopped["rows"], whole[:resume_at])
        after = first_difference(resumed["rows"][resume_at:], whole[resume_at:])
        result["checks"].append({"check": f"default: steps 1..{resume_at} run twice, bitwise", "first_difference": repeat,
                                 "passed": repeat is None})
        result["checks"].append({"check": f"default: stopped at {resume_at}, resumed to {len(whole)}, bitwise",
                                 "first_difference": after, "passed": after is None})
        shutil.rmtree(out, ignore_errors=True)

    # in order; each is left out once the budget is spent, or when the run it compares with was
    work = [("default", lambda: timed_run("default")), ("mixtral-1gpu", lambda: timed_run("mixtral-1gpu")),
            ("precision", precision), ("cpu", cpu), ("resume", resume)]
    needs = {"precision": "mixtral-1gpu", "cpu": "default", "resume": "default"}
    for name, step in work:
        if ctx.out_of_time() or (name in needs and needs[name] not in runs):
            result["left_out"].append(name)
            continue
        print(f"  train: {name}", flush=True)
        step()
        ctx.progress(result)
    problems = [f"{c['check']}: " + (f"relative loss difference {c['max_rel_diff']:.2e} > {c['tolerance']:g}"
                                     if "max_rel_diff" in c else f"first differs at step {c['first_difference']}")
                for c in result["checks"] if not c["passed"]]
    if ctx.device == "cuda" and "mixtral-1gpu" in runs:
        mfu = next(r["mfu"] for r in result["runs"] if r["run"] == "mixtral-1gpu")
        if mfu < MFU_TARGET:
            problems.append(f"mixtral-1gpu: MFU {mfu:.1%}, expected at least {MFU_TARGET:.0%}")
    if result["left_out"]:
        problems.append(f"not run (budget spent, or what it compares with was not run): {', '.join(result['left_out'])}")
    return {**result, "problems": problems, "passed": not problems}


def markdown(result: dict) -> list[str]:
    lines = [f"shardmoe train's loop on the device, {STEPS if not result['dry_run'] else DRY_RUN['steps']} steps a run; "
             f"tokens/s and MFU after the first logging interval, MFU against {result.get('peak_source', '-')}.", ""]
    lines += table(["run", "dtype", "model", "tokens/step", "tokens/s", "MFU", "peak GiB", "loss first -> last"],
                   [[r["run"], r["dtype"], " ".join(f"{k}={v}" for k, v in r["model"].items()),
                     fmt(r["tokens_per_step"], ".0f"), fmt(r["tokens_per_s"], ".0f"), fmt(r["mfu"], ".1%"),
                     fmt(r["peak_gib"], ".2f"), f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}"]
                    for r in result["runs"]])
    lines.append("")
    for c in result["checks"]:
        detail = (f"max relative loss difference {c['max_rel_diff']:.2e} over {c['steps']} steps (tolerance "
                  f"{c['tolerance']:g})" if "max_rel_diff" in c else
                  "bitwise" if c["first_difference"] is None else f"first differs at step {c['first_difference']}")
        lines.append(f"- {c['check']}: {detail}: {'ok' if c['passed'] else 'FAILED'}")
    return lines + [""] + [f"- {p}" for p in result.get("problems", [])]
