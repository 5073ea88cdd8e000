"""One (shape, dtype) case: every candidate built, checked, measured and timed; its table rows.

Per candidate: median and minimum seconds, GFLOP/s = total_flops / median, the fraction of
the dense ceiling (median_dense / median), speedups (median_anchor / median), saved bytes for
backward, the step's peak bytes (after the timing, one profiled step each), and the relative
error of outputs and gradients against transformers.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from shardmoe.tools.bench import candidates
from shardmoe.tools.bench.candidates import CANDIDATES
from shardmoe.tools.bench.flops import Shape, expert_flops, router_flops, total_flops
from shardmoe.tools.bench.peak_bytes import peak_with_pools
from shardmoe.tools.bench.saved_bytes import SavedBytes, measure_saved_bytes
from shardmoe.tools.bench.timing import time_interleaved

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# the CPU layer's bars (docs/benchmarks.md, "Targets"), by dtype: (speed-up vs transformers >=,
# fraction of dense >=, saved bytes vs transformers <=); bf16's dense ceiling is the harder one on this CPU
TARGETS = {"fp32": (1.25, 0.85, 0.5), "bf16": (1.5, 0.5, 0.5)}


@dataclass
class Row:
    candidate: str
    median_s: float
    min_s: float
    gflops: float
    repeats: int
    fraction_of_dense: float | None = None
    speedup_vs_transformers: float | None = None
    speedup_vs_loop: float | None = None
    saved_bytes: int | None = None
    saved_bytes_per_token: float | None = None
    saved_input_bytes: int | None = None
    saved_vs_transformers: float | None = None
    workspace_bytes_per_token: float | None = None  # the layer's workspace after the timed steps
    # (workspace + saved bytes outside it) / transformers' saved: what the layer holds for its
    # backward and its scratch together, the saved figure with the pool counted
    footprint_vs_transformers: float | None = None
    # the step's peak allocation above weights and input, workspace counted whole (peak_bytes.py):
    # saved bytes and scratch alike, for every candidate with a forward
    peak_bytes_per_token: float | None = None
    peak_vs_transformers: float | None = None
    rel_err_vs_transformers: float | None = None   # max over y and every gradient of |a-b|_2 / |b|_2


@dataclass
class CaseResult:
    shape_name: str
    shape: dict
    dtype: str
    flops: int
    expert_flops: int
    router_flops: int
    warmup: int
    repeats: int
    routing: str = "fixed"
    rows: list[Row] = field(default_factory=list)

    def row(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.candidate == name), None)

    def targets(self) -> dict[str, tuple[float | None, float, bool | None]]:
        """bar name -> (measured, target, met)."""
        moe = self.row("shardmoe")
        speedup, dense, saved = TARGETS[self.dtype]
        out = {}
        for key, attr, target, higher in (
            ("speedup vs transformers", "speedup_vs_transformers", speedup, True),
            ("fraction of dense", "fraction_of_dense", dense, True),
            ("saved bytes vs transformers", "saved_vs_transformers", saved, False),
            ("saved + workspace vs transformers (one layer)", "footprint_vs_transformers", saved, False),
        ):
            v = getattr(moe, attr) if moe else None
            met = None if v is None else (v >= target if higher else v <= target)
            out[key] = (v, target, met)
        return out


def relative_error(a: dict, b: dict) -> float:
    """max over the shared keys of ||a - b||_2 / ||b||_2 (float64 norms); inf when one is not finite
    (max(worst, nan) keeps worst: a NaN would have read as agreement)."""
    worst = 0.0
    for key, va in a.items():
        vb = b.get(key)
        if va is None or vb is None:
            continue
        va, vb = va.double(), vb.double()
        error = ((va - vb).norm() / vb.norm().clamp_min(1e-300)).item()
        worst = max(worst, error if math.isfinite(error) else math.inf)
    return worst


def run_case(shape_name: str, s: Shape, dtype_name: str, device: str, warmup: int, repeats: int,
             names=CANDIDATES, budget_s: float | None = None, routing: str = "fixed") -> CaseResult:
    """Build every candidate on the same weights and input, measure saved bytes and
    cross-check outputs and gradients against transformers (this pass is the first
    warm-up round), then time the rest of the warm-up and the repeats interleaved."""
    import torch

    dtype = getattr(torch, DTYPES[dtype_name])
    result = CaseResult(shape_name, asdict(s), dtype_name, total_flops(s), expert_flops(s), router_flops(s),
                        warmup, repeats)
    if routing not in ("fixed", "fresh"):
        raise ValueError(f"routing: expected 'fixed' or 'fresh', got {routing!r}")
    fresh = max(warmup - 1, 0) + repeats if routing == "fresh" else 0
    cands, inputs = candidates.build_candidates(s, dtype, device, names, fresh_inputs=fresh)
    result.routing = routing

    saved: dict[str, SavedBytes] = {}
    in_pool: dict[str, int] = {}
    outputs: dict[str, dict] = {}
    gen = torch.Generator().manual_seed(11)
    grad_check = torch.randn(1, s.tokens, s.hidden, generator=gen).to(device=device, dtype=dtype)
    for n, c in cands.items():
        c.reset()
        if c.forward is None:
            c.step()
            continue
        sb, out = measure_saved_bytes(c.forward, c.params, (inputs[n],))
        saved[n] = sb
        if c.workspace is not None:  # saved tensors in pool blocks
            in_pool[n] = sb.in_pools([c.workspace])
        out = out.reshape(1, s.tokens, s.hidden)
        out.backward(grad_check)
        outputs[n] = {"y": out.detach(), **c.grads()}
        c.reset()
        del out

    times = time_interleaved(cands, max(warmup - 1, 0), repeats, device, budget_s)
    med = {n: statistics.median(t) for n, t in times.items()}
    peak: dict[str, int] = {}
    if device == "cpu":  # the profiler's allocator events are the CPU allocator's
        for n, c in cands.items():
            if c.forward is not None:
                peak[n] = peak_with_pools(c.step, c.reset, [] if c.workspace is None else [c.workspace])
                c.reset()
    for n in cands:
        result.rows.append(Row(n, med[n], min(times[n]), result.flops / med[n] / 1e9, len(times[n])))
    for row in result.rows:
        workspace = cands[row.candidate].workspace
        if cands[row.candidate].layer is not None:
            row.workspace_bytes_per_token = (0 if workspace is None else workspace.resident_bytes) / s.tokens
        if "dense" in med:
            row.fraction_of_dense = med["dense"] / row.median_s
        if "transformers" in med:
            row.speedup_vs_transformers = med["transformers"] / row.median_s
        if "loop" in med:
            row.speedup_vs_loop = med["loop"] / row.median_s
        sb = saved.get(row.candidate)
        if sb is not None:
            row.saved_bytes = sb.total
            row.saved_input_bytes = sb.input
            row.saved_bytes_per_token = sb.total / s.tokens
            if "transformers" in saved:
                row.saved_vs_transformers = sb.total / saved["transformers"].total
                if workspace is not None:
                    held = workspace.resident_bytes + sb.total - in_pool.get(row.candidate, 0)
                    row.footprint_vs_transformers = held / saved["transformers"].total
        if row.candidate in peak:
            row.peak_bytes_per_token = peak[row.candidate] / s.tokens
            if "transformers" in peak:
                row.peak_vs_transformers = peak[row.candidate] / peak["transformers"]
        if "transformers" in outputs and row.candidate in outputs:
            row.rel_err_vs_transformers = relative_error(outputs[row.candidate], outputs["transformers"])
    return result
