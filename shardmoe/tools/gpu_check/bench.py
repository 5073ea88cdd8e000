"""Stage bench: forward + backward of the layer in bf16 at SHAPES, against its anchors.

Candidates, built by shardmoe.tools.bench.candidates on the same weights and input (fixed routing):
  dense           the GEMMs of a dropless MoE step as one expert, into preallocated buffers: the same
                  FLOPs in the same operand shapes (dense_candidate): the ceiling
  grouped_mm      transformers' MixtralSparseMoeBlock, experts_implementation="grouped_mm"
  shardmoe        shardmoe.hf.from_block(that block): the Triton path (forced: parity.triton_context)
  shardmoe:torch  the same layer under shardmoe.settings.override(kernels=False)
Without transformers the layer gets the same weights directly (layer_candidate; checked against
float64 the same way) and grouped_mm is left out (noted).

Timing: shardmoe.tools.bench.timing.time_interleaved (rounds in rotating order, WARMUP rounds first, the
first of them autotuning the kernels); inside each step CUDA events (perf_counter on CPU) mark the
start, the end of the forward and the end of the backward, and the report gives their medians.
  TFLOP/s          total_flops(shape) / median step (every GEMM of forward + backward, the router's
                   too: shardmoe.tools.bench.flops); forward 1/3 of them, backward 2/3
  x dense          median(dense) / median: the fraction of the dense ceiling
  vs grouped_mm    median(grouped_mm) / median: above 1, faster than transformers
  peak GiB         torch.cuda.max_memory_allocated during one step, above what was allocated before it
After timing (CUDA): one shardmoe step under torch.cuda.set_sync_debug_mode("error") (host_sync):
a dropless step must not synchronise with the host.
Before timing, one step of each module candidate is checked against a float64 truth (float64_truth:
a deep copy of the shardmoe layer in float64 on the torch path, on the same bf16-rounded weights,
input and output gradient upcast). Per candidate and per tensor (output y, dL/dx, the router's,
gate_up's and down's gradients) the report gives the norm-relative error (bench.case.relative_error)
against it, and per pair of candidates the largest over those tensors. The stage fails when one of
shardmoe's own paths (CHECKED) is above CHECK_TOL against float64, or two of them are apart by more;
grouped_mm's errors are reported only: transformers' block runs its router and experts in bf16
(about 4e-2 to 7e-2 against float64 on an H100 at both shapes' H, F, E, k, shardmoe's below 5e-3).
The float64 layer and its tensors are freed before timing (about 11 GB of weights at mixtral).
SonicMoE's published H100 rates at the fine shape (SONICMOE) are printed beside shardmoe's, in
expert GEMM FLOPs (expert_flops, without the router's).
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import asdict, replace

from shardmoe.tools.bench.flops import Shape, expert_flops, router_flops, total_flops

from .report import fmt, table

SHAPES = {"mixtral": Shape(8192, 4096, 14336, 8, 2), "fine": Shape(24576, 1536, 256, 128, 8)}
DRY_RUN_SHAPES = {"mixtral": Shape(64, 32, 48, 4, 2), "fine": Shape(48, 32, 16, 16, 4)}
# SonicMoE (Guo et al., 2025), H100, bf16, S=24576 H=1536 F=256 E=128 k=8: forward / backward TFLOP/s
SONICMOE = {"shape": "fine", "forward_tflops": 365.0, "backward_tflops": 405.0}
WARMUP, REPEATS = 3, 10
DRY_RUN_WARMUP, DRY_RUN_REPEATS = 0, 1  # the check step before the timing warms up; one round shows the path
CHECK_TOL = 2e-2  # bf16 norm-relative error against float64, and between shardmoe's two paths
NAMES = {"transformers": "grouped_mm"}  # the bench's candidate name -> this report's
# the check's tensors: grads()' keys -> this report's names (p0 is the router's [E, H] gradient)
TENSORS = {"y": "y", "x": "x", "p0": "router", "p1": "gate_up", "p2": "down"}
LAYER_VARIANTS = ("shardmoe:torch",)  # the shardmoe candidate's layer in another context
BACKENDS = {"shardmoe": "triton", "shardmoe:torch": "torch"}  # what each must run
CHECKED = tuple(BACKENDS)  # held to CHECK_TOL against float64 and each other; the others are reported
# the paths compared with each other (a pair with both sides in CHECKED is held to CHECK_TOL)
PAIRS = (("shardmoe", "shardmoe:torch"), ("shardmoe", "transformers"), ("shardmoe:torch", "transformers"))


class Clock:
    """Marks in a CUDA stream (events) or on the host (perf_counter, where every op is synchronous)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        import torch

        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def layer_candidate(s: Shape, dtype, device):
    """(the shardmoe candidate without transformers: shardmoe.MoE holding the bench's weights, its
    check input)."""
    import torch

    import shardmoe
    from shardmoe.tools.bench.candidates import Candidate, _init_weights

    router, gate_up, down = _init_weights(s, 0, device)
    layer = shardmoe.MoE(s.hidden, s.ffn, s.experts, s.top_k, dtype=dtype, device=device)
    with torch.no_grad():
        layer.gate_weight.copy_(router.t())
        layer.gate_up_proj.copy_(gate_up)
        layer.down_proj.copy_(down)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, s.tokens, s.hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(1, s.tokens, s.hidden, generator=gen).to(device=device, dtype=dtype)
    params = (layer.gate_weight, layer.gate_up_proj, layer.down_proj)

    def reset():
        x.grad = None
        for p in params:
            p.grad = None

    def grads():
        return {"x": x.grad, "p0": params[0].grad.t(), "p1": params[1].grad, "p2": params[2].grad}

    return (Candidate("shardmoe", lambda: layer(x).backward(grad), reset, params, lambda: layer(x), grads,
                      layer=layer), x)


def build(s: Shape, dtype, device) -> tuple[dict, object, list[str]]:
    """(the bench's candidates "dense", "transformers", "shardmoe"; the shardmoe candidate's check
    input, from which the float64 truth is computed; notes on what could not be built)."""
    from shardmoe.tools.bench import candidates as bc

    try:
        cands, inputs = bc.build_candidates(s, dtype, device, ("dense", "transformers", "shardmoe"))
        return cands, inputs["shardmoe"], []
    except Exception as err:  # transformers absent, or its block API changed: time the rest
        gc.collect()
        note = f"grouped_mm left out: transformers' block could not be built ({type(err).__name__}: {err})"
        layer, x = layer_candidate(s, dtype, device)
        return ({"dense": bc.dense_candidate(s, dtype, device, True, "dense"), "shardmoe": layer},
                x, [note])


def output(value):
    """A block's output tensor (transformers blocks of some versions return (hidden, router logits))."""
    return value[0] if isinstance(value, tuple) else value


def contexts() -> dict:
    """Each candidate's context for its steps: shardmoe on the Triton path (parity.triton_context:
    forced), shardmoe:torch off the kernels."""
    from .parity import torch_context, triton_context

    return {"dense": contextlib.nullcontext, "transformers": contextlib.nullcontext,
            "shardmoe": triton_context, "shardmoe:torch": torch_context}


def free(cuda: bool) -> None:
    """Collect what was dropped and, on CUDA, hand the allocator's cached blocks back."""
    import torch

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def step_peak_gib(step, reset) -> float:
    """GiB of CUDA memory one step() allocates above what is allocated before it, between two
    reset()s (a candidate's gradients and saved state dropped)."""
    import torch

    reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
    reset()
    return peak


def float64_truth(layer, x, grad) -> dict:
    """y and the gradients, in a module candidate's grads() layout, of one step of a float64 deep copy
    of `layer` on the torch path, on `x` and `grad` upcast (the bf16 weights and input are exact in
    float64, so what differs from it is the computation). The copy is dropped before returning."""
    import copy

    from shardmoe import settings

    truth_layer = copy.deepcopy(layer).double()
    truth_layer.zero_grad(set_to_none=True)
    x64 = x.detach().double().requires_grad_()
    with settings.override(kernels=False):
        y = output(truth_layer(x64))
        y.backward(grad.double())
    truth = {"y": y.detach(), "x": x64.grad.reshape(x.shape), "p0": truth_layer.gate_weight.grad.t(),
             "p1": truth_layer.gate_up_proj.grad, "p2": truth_layer.down_proj.grad}
    del truth_layer, x64, y
    return truth


def check_step(c, context, grad) -> dict:
    """y and the gradients (grads() layout) of one forward + backward of module candidate c; its
    gradients are reset after."""
    c.reset()
    with context():
        out = output(c.forward())
        out.backward(grad)
    result = {"y": out.detach(), **c.grads()}
    c.reset()
    return result


def check(bases: dict, x, contexts: dict, grad, cuda: bool) -> tuple[dict, dict, list[str]]:
    """(per module candidate, in this report's names, per tensor: norm-relative error against the
    float64 truth; per pair: the largest over the tensors; the problems). The truth is computed first,
    from the shardmoe candidate's layer and its check input x, and freed before returning. It is the
    same layer's torch path in float64, so against it a path shows its bf16 error; correctness against
    the independent float64 reference (moe/reference.py) is the parity stage's."""
    from shardmoe.tools.bench.case import relative_error

    problems = []
    try:
        truth = float64_truth(bases["shardmoe"].layer, x, grad)
    except Exception as err:  # e.g. out of memory: shardmoe is then unchecked, the timing still runs
        truth = None
        problems.append(f"float64 truth not computed ({type(err).__name__}: {err}): shardmoe unchecked")
    free(cuda)
    outputs, float64 = {}, {}
    for name, c in bases.items():
        if c.forward is None:
            continue
        outputs[name] = check_step(c, contexts[name], grad)
        if truth is not None:
            float64[NAMES.get(name, name)] = {TENSORS[key]: relative_error({key: outputs[name][key]}, {key: value})
                                              for key, value in truth.items()}
    del truth
    errors, pair_problems = pair_errors(outputs)
    del outputs
    free(cuda)
    problems += [f"{name}: {tensor} error vs float64 {err:.2e} > {CHECK_TOL:g}"
                 for name in CHECKED for tensor, err in float64.get(name, {}).items() if not err <= CHECK_TOL]
    return float64, errors, problems + pair_problems


def pair_errors(outputs: dict) -> tuple[dict, list[str]]:
    """(per pair of PAIRS with both sides in outputs, named "a vs b" in this report's names: the
    largest norm-relative error over the tensors of check_step; a problem for each pair of two
    CHECKED paths past CHECK_TOL)."""
    from shardmoe.tools.bench.case import relative_error

    errors, problems = {}, []
    for a, b in PAIRS:
        if a in outputs and b in outputs:
            pair = f"{NAMES.get(a, a)} vs {NAMES.get(b, b)}"
            errors[pair] = relative_error(outputs[a], outputs[b])
            if _held(pair) and not errors[pair] <= CHECK_TOL:
                problems.append(f"{pair}: error {errors[pair]:.2e} > {CHECK_TOL:g}")
    return errors, problems


def _held(pair: str) -> bool:
    """Whether a pair's error is held to CHECK_TOL: both sides are shardmoe's own paths."""
    return all(name in CHECKED for name in pair.split(" vs "))


def with_variants(by_name: dict) -> dict:
    """by_name with each of LAYER_VARIANTS mapped to its "shardmoe" entry (the same candidate,
    stepped in the variant's context)."""
    return {**by_name, **{name: by_name["shardmoe"] for name in LAYER_VARIANTS}}


def chosen_backends(config, x, steps_in: dict) -> tuple[dict, list[str]]:
    """(the backend each of shardmoe's paths selects for `config` on x inside its context, a problem
    for each that is not the one BACKENDS expects)."""
    from shardmoe.moe import dispatch

    chosen = {}
    for name in BACKENDS:
        with steps_in[name]():
            chosen[name] = dispatch.select(config, x).name
    return chosen, [f"{name}: expected the {want} backend, got {chosen[name]!r}"
                    for name, want in BACKENDS.items() if chosen[name] != want]


def time_steps(bases: dict, steps_in: dict, grad, clock: Clock, warmup: int, repeats: int, device) -> tuple[dict, dict]:
    """(the split-timed candidates, per name the marks of its timed rounds only): bases interleaved
    by time_interleaved, each step in its context."""
    from shardmoe.tools.bench.timing import time_interleaved

    timed, marks = {}, {}
    for name, c in bases.items():
        timed[name], marks[name] = split_timed(c, steps_in[name], grad, clock)
    times = time_interleaved(timed, warmup, repeats, device)
    # warm-up rounds come first; on CUDA the peak-memory step appends after the timed rounds
    return timed, {name: marks[name][warmup:warmup + len(times[name])] for name in timed}


def host_sync(c, context) -> str | None:
    """None when one step of candidate c made no host synchronisation under
    torch.cuda.set_sync_debug_mode("error") (no .item(), no copy to the host, no wait for the
    device), else the first line of the error. CUDA only; after warm-up (autotuning benchmarks)."""
    import torch

    c.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with context():
            c.step()
    except RuntimeError as err:
        return str(err).strip().splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        c.reset()
    return None


def split_timed(c, context, grad, clock: Clock):
    """(a copy of candidate c whose step marks start / end of forward / end of backward, the marks)."""
    marks = []

    def step():
        with context():
            start = clock.mark()
            if c.forward is None:  # dense: one block of GEMMs
                c.step()
                marks.append((start, None, clock.mark()))
                return
            out = output(c.forward())
            middle = clock.mark()
            out.backward(grad)
            marks.append((start, middle, clock.mark()))

    return replace(c, step=step), marks


def measure(shape_name: str, s: Shape, ctx) -> dict:
    import torch

    dtype, device, cuda = torch.bfloat16, ctx.device, ctx.device == "cuda"
    warmup, repeats = (DRY_RUN_WARMUP, DRY_RUN_REPEATS) if ctx.dry_run else (WARMUP, REPEATS)
    print(f"  {shape_name}: {s}, bf16, building the candidates", flush=True)
    cands, x, notes = build(s, dtype, device)
    gen = torch.Generator().manual_seed(11)
    grad = (torch.randn(1, s.tokens, s.hidden, generator=gen) / s.hidden ** 0.5).to(device=device, dtype=dtype)
    layer = cands["shardmoe"].layer
    steps_in = contexts()
    bases = with_variants(cands)
    chosen, wrong_backends = chosen_backends(layer.config, grad, steps_in)
    float64, errors, problems = check(bases, x, steps_in, grad, cuda)
    del x
    clock = Clock(cuda)
    timed, kept_marks = time_steps(bases, steps_in, grad, clock, warmup, repeats, device)
    peaks = {}
    if cuda:
        peaks = {name: step_peak_gib(c.step, bases[name].reset) for name, c in timed.items()}
        synced = host_sync(bases["shardmoe"], steps_in["shardmoe"])
        if synced is not None:
            problems.append(f"shardmoe: a dropless step synchronised with the host: {synced}")
    flops = total_flops(s)
    rows = []
    for name in timed:
        kept = kept_marks[name]
        step_ms = [clock.ms(a, b) for a, _, b in kept]
        forward_ms = [clock.ms(a, m) for a, m, _ in kept if m is not None]
        backward_ms = [clock.ms(m, b) for _, m, b in kept if m is not None]
        med = statistics.median(step_ms)
        fwd = statistics.median(forward_ms) if forward_ms else None
        bwd = statistics.median(backward_ms) if backward_ms else None
        rows.append({"candidate": NAMES.get(name, name), "median_ms": med, "min_ms": min(step_ms),
                     "forward_ms": fwd, "backward_ms": bwd, "repeats": len(step_ms),
                     "tflops": flops / med / 1e9, "forward_tflops": None if fwd is None else flops / 3 / fwd / 1e9,
                     "backward_tflops": None if bwd is None else 2 * flops / 3 / bwd / 1e9,
                     "expert_forward_tflops": None if fwd is None else expert_flops(s) / 3 / fwd / 1e9,
                     "expert_backward_tflops": None if bwd is None else 2 * expert_flops(s) / 3 / bwd / 1e9,
                     "peak_gib": peaks.get(name)})
    by_name = {r["candidate"]: r for r in rows}
    for r in rows:
        r["fraction_of_dense"] = by_name["dense"]["median_ms"] / r["median_ms"]
        r["speedup_vs_grouped_mm"] = by_name["grouped_mm"]["median_ms"] / r["median_ms"] if "grouped_mm" in by_name \
            else None
    problems += wrong_backends
    result = {"shape_name": shape_name, "shape": asdict(s), "dtype": "bf16", "flops": flops,
              "expert_flops": expert_flops(s), "router_flops": router_flops(s), "warmup": warmup, "repeats": repeats,
              "timing": "CUDA events" if cuda else "perf_counter (CPU)", "backends": chosen,
              "float64_errors": float64, "checked": list(CHECKED), "check_tol": CHECK_TOL, "errors": errors,
              "host_sync": None if not cuda else ("none" if synced is None else synced),
              "rows": rows, "notes": notes, "problems": problems}
    if shape_name == SONICMOE["shape"]:
        result["sonicmoe"] = {**SONICMOE, "published_shape": asdict(SHAPES[SONICMOE["shape"]]),
                              "same_shape": s == SHAPES[SONICMOE["shape"]],
                              "shardmoe_forward_tflops": by_name["shardmoe"]["expert_forward_tflops"],
                              "shardmoe_backward_tflops": by_name["shardmoe"]["expert_backward_tflops"]}
    del cands, bases, timed, kept_marks, layer
    free(cuda)
    return result


def run(ctx) -> dict:
    shapes = DRY_RUN_SHAPES if ctx.dry_run else SHAPES
    cases, left_out = [], []
    for name, s in shapes.items():
        if ctx.out_of_time():
            left_out.append(name)
            continue
        cases.append(measure(name, s, ctx))
        for line in markdown({"cases": cases[-1:]})[2:]:
            print("  " + line, flush=True)
        ctx.progress({"cases": cases})
    return {"cases": cases, "left_out": left_out, "passed": not any(c["problems"] for c in cases) and not left_out}


def markdown(result: dict) -> list[str]:
    lines = []
    for c in result["cases"]:
        s = Shape(**c["shape"])
        lines += [f"### {c['shape_name']}: {s}, {c['dtype']}", "",
                  f"GEMM FLOPs per step {c['flops'] / 1e12:.3f} T (experts {c['expert_flops'] / 1e12:.3f} T); "
                  f"median of {c['repeats']} steps after {c['warmup']} warm-up, {c['timing']}; fixed routing.", ""]
        lines += table(["candidate", "step ms", "fwd ms", "bwd ms", "TFLOP/s", "fwd TFLOP/s", "bwd TFLOP/s",
                        "x dense", "vs grouped_mm", "peak GiB", "n"],
                       [[r["candidate"], fmt(r["median_ms"], ".2f"), fmt(r["forward_ms"], ".2f"),
                         fmt(r["backward_ms"], ".2f"), fmt(r["tflops"], ".1f"), fmt(r["forward_tflops"], ".1f"),
                         fmt(r["backward_tflops"], ".1f"), fmt(r["fraction_of_dense"], ".2f"),
                         fmt(r["speedup_vs_grouped_mm"], ".2f"), fmt(r["peak_gib"], ".2f"), r["repeats"]]
                        for r in c["rows"]])
        lines += ["", "Check before timing: norm-relative error against float64 (the shardmoe layer in float64 on "
                  "the torch path, same weights, input and output gradient), per tensor:", ""]
        lines += table(["candidate", *TENSORS.values(), "bound"],
                       [[name, *(fmt(errs.get(t), ".1e") for t in TENSORS.values()),
                         f"<= {CHECK_TOL:g}" if name in CHECKED else "reported"]
                        for name, errs in c.get("float64_errors", {}).items()])
        lines += ["", "Between candidates (largest over the tensors): "
                  + ", ".join(f"{pair} {err:.1e}" + (f" (<= {CHECK_TOL:g})" if _held(pair) else "")
                              for pair, err in c["errors"].items())
                  + f"; backends {c['backends']}."]
        if "grouped_mm" in c.get("float64_errors", {}):
            lines += ["", "grouped_mm's errors are reported, not checked: transformers' block runs its router and "
                      "experts in bf16."]
        sonic = c.get("sonicmoe")
        if sonic:
            caveat = "" if sonic["same_shape"] else " (this run's shape is not the published one: not comparable)"
            lines += ["", f"SonicMoE, published (H100, {Shape(**sonic['published_shape'])}): forward "
                      f"{sonic['forward_tflops']:g}, backward {sonic['backward_tflops']:g} TFLOP/s; shardmoe here: "
                      f"forward {sonic['shardmoe_forward_tflops']:.1f}, backward "
                      f"{sonic['shardmoe_backward_tflops']:.1f} TFLOP/s (expert GEMM FLOPs){caveat}."]
        for note in c["notes"] + c["problems"]:
            lines += ["", f"- {note}"]
        lines.append("")
    if result.get("left_out"):
        lines += [f"Not run (budget spent): {', '.join(result['left_out'])}"]
    return lines
