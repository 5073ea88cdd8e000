"""The router's two GEMMs on CPU in the two layouts shardmoe.moe.routing chooses between.

  logits  x Wg               x [S, H], Wg [H, E]: Wg row-major (plain) or column-major (narrow)
  dWg     x^T dlogits        [H, S] x [S, E] (plain) or (dlogits^T x)^T (narrow)
  autograd                   x Wg and its backward through autograd (as convert's RouterLogits runs
                             it), in --autograd-dtype (the model's dtype; default float32)

routing.gate_logits / gate_weight_grad take the narrow forms for E <= NARROW_ROUTER on CPU (the
third, dx = dlogits Wg^T, is one layout only and not timed here). Both forms of each are timed side
by side (interleaved rounds, the order reversed every other round, median), in float32 (the router's
accumulation dtype), and printed as time(plain) / time(narrow): above 1, the narrow form is faster.

With --layer e8|fine it times instead the router's share of a shardmoe.MoE training step at the
layer bench's shape (bench/flops.py SHAPES, --tokens tokens, bf16 or --dtype fp32; --hidden and
--experts are the shape's): routing.route and routing.grad_gate_gemm wrapped with timers over 10
steps after 3 warm-up steps.

  python benchmarks/router_gemms.py --threads 2 [--tokens 4096] [--hidden 512] [--experts 2 4 8 12 16 64]
  python benchmarks/router_gemms.py --threads 2 --layer e8 --tokens 2048 [--dtype fp32]
"""
from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch

import shardmoe
from shardmoe.tools.bench.flops import SHAPES
from shardmoe.moe import routing


def interleaved(fns: dict, rounds: int = 9, inner: int = 5) -> dict[str, float]:
    """Median seconds per call of each function, the functions taking turns round by round (in
    reverse order every other round, so neither always runs first)."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for r in range(rounds):
        for name, fn in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(t) for name, t in times.items()}


def layer_share(shape: str, tokens: int, dtype: torch.dtype, steps: int = 10) -> None:
    """Print ms per step of a layer's forward + backward and of its router's two functions in it."""
    _, hidden, ffn, experts, top_k = SHAPES[shape]
    spent = collections.Counter()
    originals = {name: getattr(routing, name) for name in ("route", "grad_gate_gemm")}

    def timed(name):
        @functools.wraps(originals[name])
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = originals[name](*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return out
        return wrapper

    layer = shardmoe.MoE(hidden_size=hidden, ffn_size=ffn, num_experts=experts, top_k=top_k).to(dtype)
    xs = [torch.randn(tokens, hidden, dtype=dtype, requires_grad=True) for _ in range(8)]
    grad = torch.randn(tokens, hidden, dtype=dtype)

    def step(i):
        layer.zero_grad(set_to_none=True)
        layer(xs[i % len(xs)]).backward(grad)

    try:
        for name in originals:  # the layer's router (GateRouter) calls them through the module
            setattr(routing, name, timed(name))
        for i in range(3):
            step(i)
        spent.clear()
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        total = (time.perf_counter() - start) / steps
    finally:
        for name, fn in originals.items():
            setattr(routing, name, fn)
    router = sum(spent.values()) / steps
    print(f"{shape} S={tokens} {dtype}: step {1e3 * total:.1f} ms; route {1e3 * spent['route'] / steps:.1f} ms, "
          f"grad_gate_gemm {1e3 * spent['grad_gate_gemm'] / steps:.1f} ms: router {router / total:.1%} of the step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8, 10, 12, 16, 24, 64, 128])
    parser.add_argument("--layer", choices=sorted(SHAPES),
                        help="the router's share of a layer step at this shape instead (--hidden, --experts unused)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="the layer's dtype (with --layer)")
    parser.add_argument("--autograd-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the dtype of the autograd column")
    args = parser.parse_args()
    for name in ("threads", "tokens", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    if min(args.experts) < 1:
        parser.error(f"--experts: expected ints >= 1, got {args.experts}")
    torch.set_num_threads(args.threads)
    if args.layer:
        layer_share(args.layer, args.tokens, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
        return
    S, H = args.tokens, args.hidden
    autograd_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.autograd_dtype]
    print(f"router GEMMs, float32, S={S} H={H}, {torch.get_num_threads()} threads; ms per call (median), "
          f"plain / narrow; autograd in {autograd_dtype}")
    for E in args.experts:
        x, weight, grad = torch.randn(S, H), torch.randn(H, E), torch.randn(S, E)
        logits = interleaved(dict(plain=lambda: x @ weight, narrow=lambda: x @ weight.t().contiguous().t()))
        dweight = interleaved(dict(plain=lambda: x.t() @ grad, narrow=lambda: (grad.t() @ x).t().contiguous()))
        xa, wa = (t.to(autograd_dtype).requires_grad_() for t in (x, weight))
        ga = grad.to(autograd_dtype)
        graph = interleaved(dict(plain=lambda: (xa @ wa).backward(ga),
                                 narrow=lambda: (xa @ wa.t().contiguous().t()).backward(ga)))
        print(f"E={E:<4} logits {1e3 * logits['plain']:7.3f} / {1e3 * logits['narrow']:7.3f} "
              f"= {logits['plain'] / logits['narrow']:4.2f}x   dWg {1e3 * dweight['plain']:7.3f} / "
              f"{1e3 * dweight['narrow']:7.3f} = {dweight['plain'] / dweight['narrow']:4.2f}x   autograd "
              f"{1e3 * graph['plain']:7.3f} / {1e3 * graph['narrow']:7.3f} = {graph['plain'] / graph['narrow']:4.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
