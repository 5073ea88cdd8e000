"""The sparse blocks' share of a whole-model training step, per experts implementation.

For a family's causal LM as `shardmoe bench --hf FAMILY --model` builds it, one training step
(forward with labels, loss.backward()) is timed as a whole, and the time inside its experts
modules (forward, between forward hooks; backward, between full backward hooks) is summed. The
share f of the experts in grouped_mm's step bounds what any experts implementation can gain on the
whole model: with an experts speedup r the step speeds up by 1 / ((1 - f) + f / r). Printed with
the dense anchor's ratio r_dense (the layer bench's dense matmuls of the experts' and router's
FLOPs, against grouped_mm's experts modules, measured here on the same shapes), that is the
whole-model ratio a layer running at the dense rate would give.

  python benchmarks/model_share.py --family mixtral --dtype bf16 --threads 2 [--steps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import shardmoe.hf  # noqa: F401  (registers "shardmoe")
from shardmoe.tools.bench.hf_model import DEFAULTS, FAMILY_DEFAULTS, build_model


def experts_modules(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


class ExpertsClock:
    """Wall time spent inside the experts modules, forward and backward, since the last reset."""

    def __init__(self, modules):
        self.seconds, self.start = 0.0, {}
        for m in modules:
            m.register_forward_pre_hook(lambda mod, args: self._open(("f", id(mod))))
            m.register_forward_hook(lambda mod, args, out: self._close(("f", id(mod))))
            m.register_full_backward_pre_hook(lambda mod, grad: self._open(("b", id(mod))))
            m.register_full_backward_hook(lambda mod, gi, go: self._close(("b", id(mod))))

    def _open(self, key):
        self.start[key] = time.perf_counter()

    def _close(self, key):
        self.seconds += time.perf_counter() - self.start.pop(key)


def dense_anchor_seconds(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, dtype) -> float:
    """Median seconds of the layer bench's dense anchor for one layer (shardmoe.tools.bench.candidates:
    the experts' and router's forward + backward GEMMs as if every row went to one expert, into
    preallocated outputs)."""
    from shardmoe.tools.bench.candidates import dense_candidate
    from shardmoe.tools.bench.flops import Shape

    anchor = dense_candidate(Shape(tokens, hidden, ffn, experts, top_k), dtype, "cpu", preallocated=True,
                             name="dense")
    anchor.step()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        anchor.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


QUICK = dict(batch=2, seq_len=16, hidden=64, ffn=32, experts=4, top_k=2, layers=2, vocab=128)


def measure(family: str, dtype, sizes: dict, steps: int, seed: int = 0) -> dict:
    """{implementation: (median step seconds, median seconds inside the experts)} for grouped_mm and
    shardmoe on one model, each run twice in turn (the second run counts: both warm), fresh token
    ids every step; and "dense": the dense anchor's seconds for all layers' experts FLOPs."""
    model = build_model(family, dtype, **sizes)
    clock = ExpertsClock(experts_modules(model))
    gen = torch.Generator().manual_seed(seed)
    rows = {}
    for impl in ("grouped_mm", "shardmoe", "grouped_mm", "shardmoe"):
        model.config._experts_implementation = impl
        step_s, inside = [], []
        for i in range(steps + 1):
            ids = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq_len"]), generator=gen)
            model.zero_grad(set_to_none=True)
            clock.seconds = 0.0
            t = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if i:  # the first step warms up
                step_s.append(time.perf_counter() - t)
                inside.append(clock.seconds)
        rows[impl] = (statistics.median(step_s), statistics.median(inside))
    tokens = sizes["batch"] * sizes["seq_len"]
    rows["dense"] = dense_anchor_seconds(tokens, sizes["hidden"], sizes["ffn"], sizes["experts"], sizes["top_k"],
                                         dtype) * sizes["layers"]
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="mixtral")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one step (a smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sizes = {**DEFAULTS, **FAMILY_DEFAULTS.get(args.family, {}), **(QUICK if args.quick else {})}
    steps = 1 if args.quick else args.steps
    print(f"model_share: {args.family} {args.dtype} threads={args.threads} B={sizes['batch']} L={sizes['seq_len']} "
          f"H={sizes['hidden']} F={sizes['ffn']} E={sizes['experts']} k={sizes['top_k']} layers={sizes['layers']}")
    rows = measure(args.family, dtype, sizes, steps)
    dense = rows.pop("dense")
    gmm_step, gmm_experts = rows["grouped_mm"]
    f = gmm_experts / gmm_step
    print(f"{'experts':<11} {'step ms':>8} {'experts ms':>10} {'share':>6} {'vs gmm (step)':>13} {'vs gmm (experts)':>16}")
    for impl, (step, inside) in rows.items():
        print(f"{impl:<11} {1e3 * step:8.1f} {1e3 * inside:10.1f} {inside / step:6.2f} {gmm_step / step:12.2f}x "
              f"{gmm_experts / inside:15.2f}x")
    r_dense = gmm_experts / dense
    print(f"dense anchor: {1e3 * dense:.1f} ms for the experts' FLOPs ({r_dense:.2f}x grouped_mm's experts); a layer "
          f"at the dense rate would make the step {1 / ((1 - f) + f / r_dense):.2f}x grouped_mm's")


if __name__ == "__main__":
    main()
