"""Stage model: a whole transformers model, one training step (forward with labels, loss.backward()),
with its sparse blocks on shardmoe's experts seam (experts_implementation="shardmoe") against
transformers' grouped_mm.

The model (MODEL): a Qwen3-MoE-like causal LM (transformers' qwen3_moe family, built from a local
config by shardmoe.tools.bench.hf_model.build_model: nothing is downloaded), 4 decoder layers, H=2048,
E=128 experts of F=768, k=8, one sequence of S=4096 tokens, bf16, a 32768-token vocabulary (so that
the LM head does not swamp the blocks). It is built on the GPU (allocated and initialised there,
then cast), and deep-copied once: one copy per implementation (transformers'
set_experts_implementation). Every step takes a new batch of random token ids (fresh routing).

Before timing, one step of each on the same batch: the backends shardmoe's blocks selected (each
must be "triton"), the two losses and their relative difference, and the relative 2-norm error of
every gradient between the two (reported, not held to a bound: grouped_mm routes and combines in
bf16). Timing: shardmoe.tools.bench.timing.time_interleaved, WARMUP warm-up rounds (the first autotunes)
then REPEATS timed ones; the report gives median ms per step, grouped_mm / shardmoe (above 1,
shardmoe is faster) and the peak memory of one step above what was allocated before it.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
from dataclasses import asdict, dataclass

from .report import fmt, table


@dataclass(frozen=True)
class ModelSizes:
    batch: int
    seq_len: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    layers: int
    vocab: int


MODEL = ModelSizes(batch=1, seq_len=4096, hidden=2048, ffn=768, experts=128, top_k=8, layers=4, vocab=32768)
DRY_RUN_MODEL = ModelSizes(batch=1, seq_len=32, hidden=64, ffn=32, experts=8, top_k=2, layers=2, vocab=128)
FAMILY = "qwen3_moe"
IMPLEMENTATIONS = ("shardmoe", "grouped_mm")
WARMUP, REPEATS = 2, 10
DRY_RUN_WARMUP, DRY_RUN_REPEATS = 0, 1  # a dry run times nothing: one round shows the path


def build(sizes: ModelSizes, device: str) -> dict:
    """{implementation: its model}, built on `device` in bf16, the same weights in each."""
    import copy

    import torch

    from shardmoe.tools.bench.hf_model import build_model

    with torch.device(device):
        model = build_model(FAMILY, torch.bfloat16, **asdict(sizes))
    models = {"grouped_mm": model, "shardmoe": copy.deepcopy(model)}
    for name, m in models.items():
        m.set_experts_implementation(name)
    return models


def run(ctx) -> dict:
    import torch

    from shardmoe.tools.bench.candidates import Candidate
    from shardmoe.tools.bench.case import relative_error
    from shardmoe.tools.bench.timing import time_interleaved
    from shardmoe.moe import dispatch

    from .bench import free, step_peak_gib
    from .parity import triton_context

    sizes, (warmup, repeats) = (DRY_RUN_MODEL, (DRY_RUN_WARMUP, DRY_RUN_REPEATS)) if ctx.dry_run \
        else (MODEL, (WARMUP, REPEATS))
    cuda = ctx.device == "cuda"
    print(f"  {FAMILY}: {sizes}, bf16, building on {ctx.device}", flush=True)
    models = build(sizes, ctx.device)
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    batches = [torch.randint(0, sizes.vocab, (sizes.batch, sizes.seq_len), generator=gen, device=ctx.device)
               for _ in range(warmup + repeats + 1)]
    # the shardmoe copy's steps run on the Triton path (forced: a dry run's CPU tensors go to the interpreter)
    contexts = {"shardmoe": triton_context, "grouped_mm": contextlib.nullcontext}

    def candidate(name):
        net, turn = models[name], [0]

        def run_batch(ids):
            with contexts[name]():
                loss = net(input_ids=ids, labels=ids).loss
                loss.backward()
            return loss.detach()

        def step():
            turn[0] += 1
            run_batch(batches[1 + (turn[0] - 1) % (len(batches) - 1)])

        return Candidate(name, step, lambda: net.zero_grad(set_to_none=True), forward=lambda: run_batch(batches[0]),
                         grads=lambda: {n: p.grad for n, p in net.named_parameters() if p.grad is not None})

    cands = {name: candidate(name) for name in IMPLEMENTATIONS}
    chosen, select = [], dispatch.select

    def recording(*args, **kwargs):
        ops = select(*args, **kwargs)
        chosen.append(ops.name)
        return ops

    losses, grads = {}, {}
    for name, c in cands.items():
        c.reset()
        dispatch.select = recording if name == "shardmoe" else select
        try:
            losses[name] = float(c.forward())
        finally:
            dispatch.select = select
        grads[name] = c.grads()
    grad_error = relative_error(grads["shardmoe"], grads["grouped_mm"])
    del grads
    for c in cands.values():
        c.reset()
    free(cuda)
    problems = [] if chosen and set(chosen) == {"triton"} else [
        f"shardmoe's blocks: expected the triton backend in every forward and backward, got {sorted(set(chosen))}"]
    times = time_interleaved(cands, warmup, repeats, ctx.device)
    peaks = {}
    if cuda:
        peaks = {name: step_peak_gib(c.step, c.reset) for name, c in cands.items()}
    median_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    del cands, models
    gc.collect()
    free(cuda)
    return {"family": FAMILY, "sizes": asdict(sizes), "dtype": "bf16", "warmup": warmup, "repeats": repeats,
            "timing": "CUDA synchronize + perf_counter" if cuda else "perf_counter (CPU)",
            "backends": sorted(set(chosen)), "loss": losses,
            "loss_rel_diff": abs(losses["shardmoe"] - losses["grouped_mm"]) / abs(losses["grouped_mm"]),
            "grad_rel_error": grad_error, "median_ms": median_ms,
            "grouped_mm_over_shardmoe": median_ms["grouped_mm"] / median_ms["shardmoe"], "peak_gib": peaks,
            "problems": problems, "passed": not problems}


def markdown(result: dict) -> list[str]:
    s = result["sizes"]
    lines = [f"{result['family']}: {s['layers']} layers, H={s['hidden']} E={s['experts']} F={s['ffn']} "
             f"k={s['top_k']}, {s['batch']} x {s['seq_len']} tokens, vocab {s['vocab']}, {result['dtype']}; "
             f"one training step, median of {result['repeats']} after {result['warmup']} warm-up, {result['timing']}.",
             ""]
    lines += table(["implementation", "step ms", "peak GiB", "loss"],
                   [[name, fmt(result["median_ms"][name], ".2f"), fmt(result["peak_gib"].get(name), ".2f"),
                     fmt(result["loss"][name], ".6f")] for name in result["median_ms"]])
    lines += ["", f"grouped_mm / shardmoe: {result['grouped_mm_over_shardmoe']:.2f}x (above 1, shardmoe is faster); "
              f"loss difference {result['loss_rel_diff']:.1e}, gradients {result['grad_rel_error']:.1e} apart "
              f"(relative 2-norm; reported: grouped_mm routes in bf16); shardmoe's backends {result['backends']}.", ""]
    return lines + [f"- {p}" for p in result["problems"]]
