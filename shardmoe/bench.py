"""`shardmoe bench`: forward+backward of the fused MoE layer against its anchors.

One run times, side by side and interleaved on the same weights and input:
  transformers  transformers' MixtralSparseMoeBlock with experts_implementation="grouped_mm"
                (its fastest one on CPU; "batched_mm" gathers a [S*k, 2F, H] weight copy)
  loop          a per-expert-loop autograd baseline (index_select, F.linear, silu*up, index_add)
  dense         plain matmuls of the same FLOPs and shapes into preallocated buffers: the ceiling
  dense+alloc   the same matmuls allocating their outputs, as autograd does (allocator cost)
  shardmoe      shardmoe.MoE (FusedMoE, explicit backward)
and reports median time, GFLOP/s, the fraction of the dense ceiling, speedups, and the bytes
each layer saves for backward per token. Method and formulas: docs/benchmarks.md.

Heavy imports (torch, transformers) happen inside functions, so `shardmoe --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

# name -> (S, H, F, E, k)
SHAPES = {
    "e8": (4096, 512, 1024, 8, 2),    # Mixtral-like: few wide experts
    "e64": (4096, 512, 128, 64, 2),   # fine-grained: many narrow experts
}
QUICK_TOKENS = 512
QUICK_BUDGET_S = 3.0
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
CANDIDATES = ("transformers", "loop", "dense", "dense+alloc", "shardmoe")
# the issue's bars
TARGET_SPEEDUP_VS_TRANSFORMERS = 1.1
TARGET_FRACTION_OF_DENSE = 0.85
TARGET_SAVED_VS_TRANSFORMERS = 0.5


# --------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int

    def __str__(self) -> str:
        return f"S={self.tokens} H={self.hidden} F={self.ffn} E={self.experts} k={self.top_k}"


def expert_flops(s: Shape) -> int:
    """GEMM FLOPs of the SwiGLU experts, forward + backward, dropless.

    M = S*k dispatched rows. Forward: h = x Wgu^T (2*M*H*2F) and y = a Wd^T (2*M*F*H).
    Backward repeats each GEMM twice (input gradient and weight gradient), so the total
    is 3 x forward = 3 * (2*M*H*2F + 2*M*F*H) = 18*M*H*F."""
    m = s.tokens * s.top_k
    return 3 * (2 * m * s.hidden * 2 * s.ffn + 2 * m * s.ffn * s.hidden)


def router_flops(s: Shape) -> int:
    """GEMM FLOPs of the gate, forward + backward: logits = x Wg (2*S*H*E), then dx and dWg."""
    return 3 * 2 * s.tokens * s.hidden * s.experts


def total_flops(s: Shape) -> int:
    """Every GEMM FLOP of an MoE layer's forward + backward. Elementwise work (softmax,
    top-k, silu, the combine) is not counted: it is O(S*k*(F+H)) against O(S*k*H*F)."""
    return expert_flops(s) + router_flops(s)


# --------------------------------------------------------------------------------------
# Saved-activation bytes
# --------------------------------------------------------------------------------------
@dataclass
class SavedBytes:
    """What one forward keeps alive for its backward.

    total:   bytes of the distinct storages saved (parameters excluded; the input counted)
    input:   the part of `total` that is the input's own storage
    tensors: how many saved-tensor slots were packed (before deduplication)
    storages: how many distinct storages they held"""

    total: int
    input: int
    tensors: int
    storages: int

    @property
    def without_input(self) -> int:
        return self.total - self.input


def measure_saved_bytes(forward, params=(), inputs=()) -> tuple[SavedBytes, object]:
    """Run `forward()` under torch.autograd.graph.saved_tensors_hooks and sum the bytes of
    every distinct storage saved for backward. Returns (SavedBytes, forward's output).

    A storage is counted once however many views of it are saved (dedupe by the storage's
    data_ptr; saved tensors stay alive until backward, so pointers cannot be reused in
    between) and in full (a saved view keeps its whole storage alive). Storages of
    `params` are excluded: they live whether or not backward will run. Storages of
    `inputs` are counted (the layer's backward keeps them alive) and reported apart."""
    import torch

    def ptr(t):
        return t.untyped_storage().data_ptr()

    param_ptrs = {ptr(p) for p in params}
    input_ptrs = {ptr(x) for x in inputs}
    seen: dict[int, int] = {}
    packed = [0]

    def pack(t):
        packed[0] += 1
        p = ptr(t)
        if p and p not in param_ptrs and p not in seen:
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    total = sum(seen.values())
    inp = sum(n for p, n in seen.items() if p in input_ptrs)
    return SavedBytes(total, inp, packed[0], len(seen)), out


# --------------------------------------------------------------------------------------
# Candidates: each builds a step() that runs one forward + backward
# --------------------------------------------------------------------------------------
def _init_weights(s: Shape, seed: int):
    """The benchmark's weights, in transformers' layouts: router [E, H], gate_up_proj
    [E, 2F, H], down_proj [E, H, F]; router and gate_up ~ N(0, 1/H), down ~ N(0, 1/F), so
    activations stay O(1) in bf16."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(s.experts, s.hidden, generator=gen) / s.hidden ** 0.5
    gate_up = torch.randn(s.experts, 2 * s.ffn, s.hidden, generator=gen) / s.hidden ** 0.5
    down = torch.randn(s.experts, s.hidden, s.ffn, generator=gen) / s.ffn ** 0.5
    return router, gate_up, down


def _mixtral_block(s: Shape, weights, dtype, device):
    """A MixtralSparseMoeBlock from a local config (no downloads) with
    experts_implementation="grouped_mm", holding `weights` (see _init_weights)."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=s.hidden, intermediate_size=s.ffn, num_local_experts=s.experts,
                           num_experts_per_tok=s.top_k, hidden_act="silu", router_jitter_noise=0.0,
                           experts_implementation="grouped_mm")
    block = MixtralSparseMoeBlock(config)
    router, gate_up, down = weights
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block.to(device=device, dtype=dtype)


def _transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: F401
    except ImportError:
        return False
    return True


def loop_moe(x, gate_weight, gate_up_proj, down_proj, top_k: int):
    """Per-expert-loop MoE in plain autograd: x [S, H] -> [S, H].

    Routing as Mixtral (softmax in fp32, top-k, renormalise); then for each expert,
    gather its tokens, run the SwiGLU FFN with F.linear, scale by the combine weight and
    index_add into the output."""
    import torch
    import torch.nn.functional as F

    probs = torch.softmax((x @ gate_weight).float(), dim=-1)
    top_prob, top_idx = torch.topk(probs, top_k, dim=-1)
    weight = (top_prob / top_prob.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    # unbind, not gate_up_proj[e]: indexing a [E, ...] parameter per expert makes autograd
    # add E full-size zero-padded gradients (O(E^2) work); unbind stacks them once
    for e, (w_gate_up, w_down) in enumerate(zip(gate_up_proj.unbind(0), down_proj.unbind(0))):
        token, slot = torch.where(top_idx == e)
        if token.numel() == 0:
            continue
        xs = x.index_select(0, token)
        gate, up = F.linear(xs, w_gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down)
        out.index_add_(0, token, y * weight[token, slot, None])
    return out


@dataclass
class Candidate:
    name: str
    step: object                 # () -> None: one forward + backward
    reset: object                # () -> None: drop gradients (outside the timed region)
    params: tuple = ()
    forward: object = None       # () -> output with graph (for saved bytes / checks)
    grads: object = None         # () -> dict of gradients after a step (for checks)
    flops: int | None = None     # GEMM FLOPs of one step, where the candidate knows them exactly


def _build_candidates(s: Shape, dtype, device, names, seed: int = 0, fresh_inputs: int = 0):
    """Candidates on the same weights and inputs. With fresh_inputs=R > 0 each module
    candidate cycles through R + 1 different inputs (so routing, and each expert's row
    count, change every step, as in training); input 0 serves forward() (the check pass),
    steps use inputs 1..R. Every candidate steps once per round, so all see the same input
    in the same round."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    x_base = torch.randn(1, s.tokens, s.hidden, generator=gen).to(device=device, dtype=dtype)
    grad_out = (torch.randn(1, s.tokens, s.hidden, generator=gen) / s.hidden ** 0.5).to(device=device, dtype=dtype)
    x_pool = [x_base] + [torch.randn(1, s.tokens, s.hidden, generator=gen).to(device=device, dtype=dtype)
                         for _ in range(fresh_inputs)]
    cands: dict[str, Candidate] = {}
    weights = _init_weights(s, seed)
    block = None
    if "transformers" in names or ("shardmoe" in names and _transformers_available()):
        block = _mixtral_block(s, weights, dtype, device)

    def module_candidate(name, module, params, x_shape, gate_transposed=False):
        """gate_transposed: params[0] is [H, E] (the router holds [E, H]); its gradient
        is compared transposed."""
        xs = [xb.reshape(x_shape).clone().requires_grad_() for xb in x_pool]
        x = xs[0]
        g = grad_out.reshape(x_shape)
        turn = [0]

        def forward():
            return module(x)

        def step():
            xi = x if len(xs) == 1 else xs[1 + turn[0] % (len(xs) - 1)]
            turn[0] += 1
            module(xi).backward(g)

        def reset():
            for xi in xs:
                xi.grad = None
            for p in params:
                p.grad = None

        def grads():
            out = {"x": x.grad.reshape(1, s.tokens, s.hidden),
                   **{f"p{i}": p.grad for i, p in enumerate(params)}}
            if gate_transposed:
                out["p0"] = out["p0"].t()
            return out

        return Candidate(name, step, reset, tuple(params), forward, grads), x

    inputs = {}
    if "transformers" in names:
        params = (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
        cands["transformers"], inputs["transformers"] = module_candidate(
            "transformers", block, params, (1, s.tokens, s.hidden))
    if "shardmoe" in names:
        import shardmoe

        if block is not None:
            layer = shardmoe.MoE.from_mixtral(block)
        else:  # the same weights, copied by hand (router [E, H] -> gate_weight [H, E])
            layer = shardmoe.MoE(s.hidden, s.ffn, s.experts, s.top_k, dtype=dtype, device=device)
            with torch.no_grad():
                for p, w in zip((layer.gate_weight, layer.gate_up_proj, layer.down_proj),
                                (weights[0].t(), weights[1], weights[2])):
                    p.copy_(w)
        params = (layer.gate_weight, layer.gate_up_proj, layer.down_proj)
        cands["shardmoe"], inputs["shardmoe"] = module_candidate(
            "shardmoe", layer, params, (1, s.tokens, s.hidden), gate_transposed=True)
    if "loop" in names:
        wg, wgu, wd = (w.to(device=device, dtype=dtype).requires_grad_()
                       for w in (weights[0].t().contiguous(), weights[1], weights[2]))
        params = (wg, wgu, wd)
        cands["loop"], inputs["loop"] = module_candidate(
            "loop", lambda x: loop_moe(x, wg, wgu, wd, s.top_k), params, (s.tokens, s.hidden),
            gate_transposed=True)
    for name in ("dense", "dense+alloc"):
        if name in names:
            cands[name] = _dense_candidate(s, dtype, device, preallocated=(name == "dense"), name=name)
    return {n: cands[n] for n in names if n in cands}, inputs


def _dense_candidate(s: Shape, dtype, device, preallocated: bool, name: str) -> Candidate:
    """The GEMMs of a dropless MoE forward + backward as if all M = S*k rows went to one
    expert: the same FLOPs (total_flops) in the same operand shapes and layouts.

    Experts:  h  = X Wgu^T    [M,H]x[H,2F]     y   = A Wd^T   [M,F]x[F,H]
              dA = dY Wd      [M,H]x[H,F]      dWd = dY^T A   [H,M]x[M,F]
              dX = dH Wgu     [M,2F]x[2F,H]    dWgu= dH^T X   [2F,M]x[M,H]
    Router:   L  = Xs Wg      [S,H]x[H,E]      dXs = dL Wg^T  [S,E]x[E,H]   dWg = Xs^T dL  [H,S]x[S,E]
    With preallocated=True every product lands in a buffer made once (out=), so only the
    GEMM kernels are timed; otherwise each allocates its output as autograd would."""
    import torch

    S, H, F, E, k = s.tokens, s.hidden, s.ffn, s.experts, s.top_k
    M = S * k
    gen = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    X, A, dY, dH = rnd(M, H), rnd(M, F), rnd(M, H), rnd(M, 2 * F)
    Wgu, Wd = rnd(2 * F, H), rnd(H, F)
    Xs, Wg, dL = rnd(S, H), rnd(H, E), rnd(S, E)
    products = [
        (X, Wgu.t()), (A, Wd.t()),              # forward
        (dY, Wd), (dY.t(), A),                  # down-projection backward
        (dH, Wgu), (dH.t(), X),                 # gate/up backward
        (Xs, Wg), (dL, Wg.t()), (Xs.t(), dL),   # router forward + backward
    ]
    if preallocated:
        outs = [torch.empty(a.shape[0], b.shape[1], device=device, dtype=dtype) for a, b in products]

        def step():
            for (a, b), o in zip(products, outs):
                torch.mm(a, b, out=o)
    else:
        def step():
            for a, b in products:
                torch.mm(a, b)

    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in products)
    return Candidate(name, step, lambda: None, flops=flops)


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------
def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(cands: dict[str, Candidate], warmup: int, repeats: int, device,
                     budget_s: float | None = None) -> dict[str, list[float]]:
    """Seconds per forward+backward of each candidate.

    Every round runs each candidate once, starting from a different one each round (so
    no candidate always follows the same neighbour); the first `warmup` rounds are not
    recorded. With `budget_s`, a candidate whose last warm-up step took t seconds gets
    max(1, min(repeats, budget_s / (len(cands) * t))) timed rounds, so one slow anchor
    cannot stretch a smoke run; it then sits out the later rounds."""
    names = list(cands)
    times: dict[str, list[float]] = {n: [] for n in names}
    quota = dict.fromkeys(names, repeats)
    last: dict[str, float] = {}
    r = 0
    while any(len(times[n]) < quota[n] for n in names):
        if r == warmup and budget_s is not None and last:
            for n in names:
                quota[n] = max(1, min(repeats, int(budget_s / (len(names) * max(last[n], 1e-9)))))
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            if r >= warmup and len(times[n]) >= quota[n]:
                continue
            c = cands[n]
            c.reset()
            _sync(device)
            t0 = time.perf_counter()
            c.step()
            _sync(device)
            last[n] = time.perf_counter() - t0
            if r >= warmup:
                times[n].append(last[n])
        r += 1
    for c in cands.values():
        c.reset()
    return times


# --------------------------------------------------------------------------------------
# One (shape, dtype) case
# --------------------------------------------------------------------------------------
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
    notes: list[str] = field(default_factory=list)

    def row(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.candidate == name), None)

    def targets(self) -> dict[str, tuple[float | None, float, bool | None]]:
        """bar name -> (measured, target, met)."""
        moe = self.row("shardmoe")
        out = {}
        for key, attr, target, higher in (
            ("speedup vs transformers", "speedup_vs_transformers", TARGET_SPEEDUP_VS_TRANSFORMERS, True),
            ("fraction of dense", "fraction_of_dense", TARGET_FRACTION_OF_DENSE, True),
            ("saved bytes vs transformers", "saved_vs_transformers", TARGET_SAVED_VS_TRANSFORMERS, False),
        ):
            v = getattr(moe, attr) if moe else None
            met = None if v is None else (v >= target if higher else v <= target)
            out[key] = (v, target, met)
        return out


def relative_error(a: dict, b: dict) -> float:
    """max over the shared keys of ||a - b||_2 / ||b||_2 (float64 norms)."""
    worst = 0.0
    for key, va in a.items():
        vb = b.get(key)
        if va is None or vb is None:
            continue
        va, vb = va.double(), vb.double()
        worst = max(worst, ((va - vb).norm() / vb.norm().clamp_min(1e-300)).item())
    return worst


def run_case(shape_name: str, s: Shape, dtype_name: str, device: str, warmup: int, repeats: int,
             names=CANDIDATES, budget_s: float | None = None, routing: str = "fixed") -> CaseResult:
    """Build every candidate on the same weights and input, measure saved bytes and
    cross-check outputs and gradients against transformers (this pass is the first
    warm-up round), then time the rest of the warm-up and the repeats interleaved."""
    import torch

    dtype = getattr(torch, DTYPES[dtype_name])
    names = [n for n in names if n != "transformers" or _transformers_available()]
    result = CaseResult(shape_name, asdict(s), dtype_name, total_flops(s), expert_flops(s), router_flops(s),
                        warmup, repeats)
    if "transformers" not in names:
        result.notes.append("transformers is not installed: its anchor is skipped")
    if routing not in ("fixed", "fresh"):
        raise ValueError(f"routing: expected 'fixed' or 'fresh', got {routing!r}")
    fresh = max(warmup - 1, 0) + repeats if routing == "fresh" else 0
    cands, inputs = _build_candidates(s, dtype, device, names, fresh_inputs=fresh)
    result.routing = routing

    saved: dict[str, SavedBytes] = {}
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
        out = out.reshape(1, s.tokens, s.hidden)
        out.backward(grad_check)
        outputs[n] = {"y": out.detach(), **c.grads()}
        c.reset()
        del out

    times = time_interleaved(cands, max(warmup - 1, 0), repeats, device, budget_s)
    med = {n: statistics.median(t) for n, t in times.items()}
    for n in cands:
        result.rows.append(Row(n, med[n], min(times[n]), result.flops / med[n] / 1e9, len(times[n])))
    for row in result.rows:
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
        if "transformers" in outputs and row.candidate in outputs:
            row.rel_err_vs_transformers = relative_error(outputs[row.candidate], outputs["transformers"])
    return result


# --------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------
def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def format_case(r: CaseResult) -> str:
    s = Shape(**r.shape)
    lines = [
        f"[{r.shape_name} {r.dtype}] {s}   GEMM FLOPs fwd+bwd {r.flops / 1e9:.2f} G "
        f"(experts {r.expert_flops / 1e9:.2f} + router {r.router_flops / 1e9:.2f}); "
        f"median of n timed rounds (<= {r.repeats}) after {r.warmup} warm-up; {r.routing} routing",
        f"  {'candidate':<13}{'median ms':>10}{'min ms':>9}{'GFLOP/s':>9}{'x dense':>9}{'vs tf':>7}"
        f"{'vs loop':>8}{'saved B/tok':>12}{'saved/tf':>9}{'rel err':>9}{'n':>4}",
    ]
    for row in r.rows:
        lines.append(
            f"  {row.candidate:<13}{row.median_s * 1e3:>10.2f}{row.min_s * 1e3:>9.2f}{row.gflops:>9.1f}"
            f"{_fmt(row.fraction_of_dense, '.2f'):>9}{_fmt(row.speedup_vs_transformers, '.2f'):>7}"
            f"{_fmt(row.speedup_vs_loop, '.2f'):>8}{_fmt(row.saved_bytes_per_token, '.0f'):>12}"
            f"{_fmt(row.saved_vs_transformers, '.2f'):>9}{_fmt(row.rel_err_vs_transformers, '.1e'):>9}{row.repeats:>4}"
        )
    for note in r.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def format_targets(results: list[CaseResult]) -> str:
    lines = ["targets (shardmoe):"]
    for r in results:
        parts = []
        for key, (v, target, met) in r.targets().items():
            mark = "n/a" if met is None else ("ok" if met else "MISS")
            op = "<=" if key.startswith("saved") else ">="
            parts.append(f"{key} {_fmt(v, '.2f')} ({op} {target}) {mark}")
        lines.append(f"  {r.shape_name:<4} {r.dtype:<5} " + "; ".join(parts))
    return "\n".join(lines)


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
           "machine": platform.machine(), "processor": platform.processor()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    try:
        import os
        import subprocess

        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        env["cpu"] = None
    return env


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"S={QUICK_TOKENS}, 1 warm-up, <= 3 repeats, {QUICK_BUDGET_S:g} s budget per case "
                             "(a smoke run)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--shapes", nargs="+", choices=(*SHAPES, "all"), default=["all"],
                        help="e8: S=4096 H=512 F=1024 E=8 k=2; e64: S=4096 H=512 F=128 E=64 k=2")
    parser.add_argument("--tokens", type=int, default=None, help="override S (tokens) for every shape")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up rounds, the first being the saved-bytes/check pass (default 2, quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7, quick 3)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="cap the timed rounds of each case at about this long: a slow candidate gets "
                             f"fewer repeats, at least 1 (default none, quick {QUICK_BUDGET_S:g})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads before timing (default: leave torch's setting as it is)")
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--routing", choices=("fixed", "fresh"), default="fixed",
                        help="fixed: the same input every step; fresh: a new input (new routing, new "
                             "per-expert row counts) every step, as in training")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="PATH", default=None, help="write every number to this JSON file")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    # the distributed benchmark (`torchrun ... -m shardmoe bench --mesh e=4`) adds the options this
    # parser lacks (--mesh, --hidden, ...); run() hands a --mesh run (or a torchrun job) over to it
    try:
        from shardmoe.parallel import bench as distributed
    except ImportError:
        return
    distributed.add_arguments(parser)


def _distributed_requested(args: argparse.Namespace) -> bool:
    import os

    return getattr(args, "mesh", None) is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1


def run(args: argparse.Namespace) -> int:
    if _distributed_requested(args):
        from shardmoe.parallel.bench import run_distributed

        return run_distributed(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("shardmoe bench: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    shape_names = list(SHAPES) if "all" in args.shapes else list(dict.fromkeys(args.shapes))
    dtype_names = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    tokens = args.tokens if args.tokens is not None else (QUICK_TOKENS if args.quick else None)
    budget = args.budget if args.budget is not None else (QUICK_BUDGET_S if args.quick else None)
    if repeats < 1 or warmup < 0 or (tokens is not None and tokens < 1) or (budget is not None and budget <= 0):
        print("shardmoe bench: expected --repeats >= 1, --warmup >= 0, --tokens >= 1, --budget > 0",
              file=sys.stderr)
        return 2
    if args.threads is not None:
        if args.threads < 1:
            print(f"shardmoe bench: --threads: expected >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)

    env = environment()
    print(f"shardmoe bench: device={args.device} threads={env['threads']} torch {env['torch']} "
          f"transformers {env['transformers'] or '(not installed)'} cpu {env['cpu']} commit {env['commit']}")
    results = []
    for shape_name in shape_names:
        S, H, F, E, k = SHAPES[shape_name]
        # --hidden/--ffn/--experts/--top-k (added with the distributed options) override a shape
        s = Shape(tokens if tokens is not None else S, getattr(args, "hidden", None) or H,
                  getattr(args, "ffn", None) or F, getattr(args, "experts", None) or E,
                  getattr(args, "top_k", None) or k)
        for dtype_name in dtype_names:
            r = run_case(shape_name, s, dtype_name, args.device, warmup, repeats, tuple(args.candidates), budget,
                         args.routing)
            results.append(r)
            print(format_case(r), flush=True)
    print(format_targets(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "device": args.device, "quick": bool(args.quick),
                       "cases": [asdict(r) for r in results]}, f, indent=2)
        print(f"wrote {args.json}")
    missed = any(met is False for r in results for (_, _, met) in r.targets().values())
    return 1 if (args.strict and missed) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardmoe bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
