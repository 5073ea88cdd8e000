"""The router's two GEMMs on CPU in the two layouts shardmoe.moe.routing chooses between.

  logits  x Wg               x [S, H], Wg [H, E]: Wg row-major (plain) or column-major (narrow)
  dWg     x^T dlogits        [H, S] x [S, E] (plain) or (dlogits^T x)^T (narrow)

routing.gate_logits / gate_weight_grad take the narrow forms for E <= NARROW_ROUTER on CPU. Both
forms of each are timed side by side (interleaved rounds, median), in float32 (the router's
accumulation dtype), and printed as time(plain) / time(narrow): above 1, the narrow form is faster.

  python benchmarks/router_gemms.py --threads 2 [--tokens 4096] [--hidden 512] [--experts 2 4 8 12 16 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def interleaved(fns: dict, rounds: int = 9, inner: int = 5) -> dict[str, float]:
    """Median seconds per call of each function, the functions taking turns round by round."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8, 10, 12, 16, 24, 64, 128])
    args = parser.parse_args()
    for name in ("threads", "tokens", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    if min(args.experts) < 1:
        parser.error(f"--experts: expected ints >= 1, got {args.experts}")
    torch.set_num_threads(args.threads)
    S, H = args.tokens, args.hidden
    print(f"router GEMMs, float32, S={S} H={H}, {torch.get_num_threads()} threads; ms per call (median), "
          f"plain / narrow")
    for E in args.experts:
        x, weight, grad = torch.randn(S, H), torch.randn(H, E), torch.randn(S, E)
        logits = interleaved(dict(plain=lambda: x @ weight, narrow=lambda: x @ weight.t().contiguous().t()))
        dweight = interleaved(dict(plain=lambda: x.t() @ grad, narrow=lambda: (grad.t() @ x).t().contiguous()))
        print(f"E={E:<4} logits {1e3 * logits['plain']:7.3f} / {1e3 * logits['narrow']:7.3f} "
              f"= {logits['plain'] / logits['narrow']:4.2f}x   dWg {1e3 * dweight['plain']:7.3f} / "
              f"{1e3 * dweight['narrow']:7.3f} = {dweight['plain'] / dweight['narrow']:4.2f}x", flush=True)


if __name__ == "__main__":
    main()
