"""Which tool the fused CPU elementwise passes use (docs/benchmarks.md, "What the figures settle on
the CPU"): each pass of the glu expert and the combine, the stage functions' torch code (printed as
"today") against the C++ extension of shardmoe/moe/cpu.py (into fresh outputs, and into
reused ones as a workspace gives) and against torch.compile (Inductor's C++ code generation,
dynamic row counts) of the same pure function; then oneDNN's fused-activation linear (the GEMM
epilogue torch exposes on CPU). Interleaved, 9 samples per candidate, median and min ratios (> 1:
faster than the torch code), repeated --runs times.

  python benchmarks/elementwise_tools.py [--threads 2] [--runs 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from shardmoe.moe import combine, cpu, experts
from shardmoe.moe.activations import activate_backward


def today_glu_bwd(da, h, ag):
    ffn = ag.shape[1]
    gh = torch.empty_like(h)
    for c in combine.row_chunks(h):
        gh[c, :ffn] = activate_backward("silu", da[c] * h[c, ffn:], h[c, :ffn])
        torch.mul(da[c], ag[c], out=gh[c, ffn:])
    return gh


# the same passes as pure functions for torch.compile
def pure_glu_fwd(h):
    ffn = h.shape[1] // 2
    hf = h.float()
    act = F.silu(hf[:, :ffn])
    return (act * hf[:, ffn:]).to(h.dtype), act.to(h.dtype)


def pure_glu_bwd(da, h, ag):
    ffn = ag.shape[1]
    d, hf = da.float(), h.float()
    g, s = hf[:, :ffn], torch.sigmoid(hf[:, :ffn])
    return torch.cat([d * hf[:, ffn:] * s * (1 + g * (1 - s)), d * ag.float()], 1).to(h.dtype)


def pure_scale(x, w):
    return (x.float() * w[:, None]).to(x.dtype)


def pure_dot(x, a, b):
    return (x.float() * a.float() * b.float()).sum(-1)


def pure_combine(y, w, row_pair, tokens, top_k):
    out = torch.zeros((tokens, y.shape[1]), dtype=torch.float32)
    return out.index_add(0, torch.div(row_pair, top_k, rounding_mode="floor"), y.float() * w[:, None])


def sample(fn, args):
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def passes(dtype, rows, ffn, hidden, tokens, top_k, runs):
    ops = torch.ops.shardmoe_elementwise
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, 2 * ffn, generator=g).to(dtype)
    da = torch.randn(rows, ffn, generator=g).to(dtype)
    ag = F.silu(h[:, :ffn])
    y = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.rand(rows, generator=g)
    row_pair = torch.randperm(rows, generator=g)
    reused = {"a": torch.empty(rows, ffn, dtype=dtype), "g": torch.empty(rows, ffn, dtype=dtype),
              "gh": torch.empty_like(h), "s": torch.empty_like(da)}
    cases = {  # name: (today, C++ fresh, C++ reused, pure function, args)
        "glu forward": (lambda h: experts.glu_activation(experts.TORCH_OPS, h, "silu"),
                        lambda h: cpu.glu_forward(h, "silu", torch.empty(rows, ffn, dtype=dtype)),
                        lambda h: ops.glu_forward(h, 3, reused["a"], reused["g"]), pure_glu_fwd, (h,)),
        "glu backward": (today_glu_bwd, lambda *a: cpu.glu_backward(*a, "silu"),
                         lambda *a: ops.glu_backward(*a, 3, reused["gh"]), pure_glu_bwd, (da, h, ag)),
        "scale [N,F]": (combine.scale_rows, cpu.scale_rows, lambda x, w: ops.scale_rows(x, w, reused["s"]),
                        pure_scale, (da, w)),
        "dot3 [N,F]": (combine.rowwise_dot, cpu.rowwise_dot, None, pure_dot,
                       (da, ag, h[:, ffn:])),
        "combine [N,H]": (combine.combine_rows,
                          lambda y, rp, s, k, w: cpu.index_add_rows(y, torch.div(rp, k, rounding_mode="floor"), s, w),
                          None, lambda y, rp, s, k, w: pure_combine(y, w, rp, s, k), (y, row_pair, tokens, top_k, w)),
    }
    compiled = {}
    for name, (_, _, _, pure, args) in cases.items():
        compiled[name] = torch.compile(pure, dynamic=True)
        first = sample(compiled[name], args)
        shorter = tuple(a[:-40] if torch.is_tensor(a) and a.dim() and a.shape[0] == rows else a for a in args)
        if name == "combine [N,H]":
            shorter = args
        print(f"  {name:14s} torch.compile: first call {first:6.2f} s, next row count {sample(compiled[name], shorter) * 1e3:6.1f} ms")
    for run in range(runs):
        for name, (today, fresh, reuse, _, args) in cases.items():
            cands = {"C++": fresh, "C++ reused out": reuse, "inductor": compiled[name]}
            cands = {k: v for k, v in cands.items() if v is not None}
            times = {k: [] for k in ["today", *cands]}
            for _ in range(9):
                times["today"].append(sample(today, args))
                for k, fn in cands.items():
                    times[k].append(sample(fn, args))
            med = {k: statistics.median(v) for k, v in times.items()}
            low = {k: min(v) for k, v in times.items()}
            ratios = "  ".join(f"{k} x{med['today'] / med[k]:.2f} (min x{low['today'] / low[k]:.2f})" for k in cands)
            print(f"  run {run} {name:14s} today {med['today'] * 1e3:6.1f} ms   {ratios}")


def onednn_epilogue(dtype, runs):
    """Per-expert linear + silu, as torch.mm then F.silu, against oneDNN's fused post-op."""
    rows, hidden, ffn, num_experts = 1024, 512, 1024, 8
    xs = [torch.randn(rows, hidden).to(dtype) for _ in range(num_experts)]
    ws = [(torch.randn(ffn, hidden) / 20).to(dtype) for _ in range(num_experts)]
    plain = lambda: [F.silu(torch.mm(x, w.t())) for x, w in zip(xs, ws)]
    fused = lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "swish", [], "") for x, w in zip(xs, ws)]
    for run in range(runs):
        tp, tf = [], []
        for _ in range(9):
            tp.append(sample(plain, ()))
            tf.append(sample(fused, ()))
        print(f"  run {run} gemm+silu {statistics.median(tp) * 1e3:.1f} ms; oneDNN silu epilogue "
              f"x{statistics.median(tp) / statistics.median(tf):.2f} (min x{min(tp) / min(tf):.2f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu.library_loaded():
        raise SystemExit("the C++ extension did not build (see the warning above)")
    for dtype in (torch.bfloat16, torch.float32):
        for label, shape in [("e8: N=8192 F=1024 H=512", (8192, 1024, 512, 4096, 2)),
                             ("fine: N=16384 F=256 H=512", (16384, 256, 512, 4096, 4))]:
            print(f"{dtype} {label}, threads {torch.get_num_threads()}")
            passes(dtype, *shape, args.runs)
        print(f"{dtype} oneDNN epilogue, 8 experts x [1024, 512] x [512, 1024]")
        onednn_epilogue(dtype, args.runs)


if __name__ == "__main__":
    main()
