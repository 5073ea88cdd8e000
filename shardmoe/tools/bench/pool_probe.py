"""What the workspace costs in memory, per layer, with one pool per layer or one pool for all.

`python -m shardmoe.tools.bench.pool_probe [--shapes e8 fine] [--dtype fp32 bf16] [--layers 1 4 16]`
stacks L layers (t = t + MoE(t), the bench's shapes, dropless), runs forward + backward steps, and
prints per token and per layer:
  saved      bytes a forward keeps for its backward (saved_bytes.measure_saved_bytes, input counted)
  pool       the workspace's resident bytes after the step: the step's peak of pooled buffers
             (every block is free again then, and kept for the next step)
  footprint  pool + the saved bytes that live outside the pool: what the layer holds for its
             backward and its scratch together, set against transformers' saved bytes (/tf)
  peak       the step's peak allocation above weights and input, pools counted whole
             (peak_bytes.py): saved bytes and scratch alike, set against transformers' (/tf)
and the same for L stacked transformers Mixtral blocks (saved, peak; its scratch is in its peak
only: autograd frees it, which no saved-tensor hook sees). Memory only, no timing: the figures
are exact for the shapes and do not depend on the machine's load.
"""
from __future__ import annotations

import argparse

LAYER_COUNTS = (1, 4, 16)
WARM_STEPS = 3  # steps before measuring: a pool reaches its steady blocks within them


def _measure_stack(x, stack, pools=()):
    """(SavedBytes of one forward, the step's peak with `pools` counted whole) of t = t + layer(t)
    over the stack, after WARM_STEPS forward + backward steps of the sum (they size the pools)."""
    from shardmoe.tools.bench.peak_bytes import peak_with_pools
    from shardmoe.tools.bench.saved_bytes import measure_saved_bytes

    params = [p for layer in stack for p in layer.parameters()]

    def forward():
        t = x
        for layer in stack:
            t = t + layer(t)
        return t

    def step():
        forward().sum().backward()

    def reset():
        for p in (x, *params):
            p.grad = None

    for _ in range(WARM_STEPS):
        reset()
        step()
    reset()
    saved, out = measure_saved_bytes(forward, params, [x])
    # finish the step as training does: dropping the graph unrun instead left a shared pool with
    # other (larger) blocks, since which free block a request takes depends on the order of frees
    out.sum().backward()
    del out
    return saved, peak_with_pools(step, reset, pools)


def probe(shape, dtype, layers: int, shared: bool) -> dict[str, float]:
    """{saved, pool, footprint, peak} in bytes per token per layer for `layers` stacked layers."""
    import torch

    import shardmoe
    from shardmoe.moe.cpu import share

    torch.manual_seed(0)
    stack = [shardmoe.MoE(shape.hidden, shape.ffn, shape.experts, shape.top_k, dtype=dtype) for _ in range(layers)]
    if shared:
        share(stack)
    x = torch.randn(shape.tokens, shape.hidden, dtype=dtype, requires_grad=True)
    pools = list({id(layer.workspace): layer.workspace for layer in stack}.values())
    saved, peak = _measure_stack(x, stack, pools)
    per = shape.tokens * layers
    resident = sum(pool.resident_bytes for pool in pools)
    footprint = resident + saved.total - saved.in_pools(pools)
    return {"saved": saved.total / per, "pool": resident / per, "footprint": footprint / per, "peak": peak / per}


def transformers_probe(shape, dtype, layers: int = 1) -> dict[str, float]:
    """{saved, peak} per token per layer of `layers` stacked transformers Mixtral blocks (the bench's
    block and weights, t = t + block(t))."""
    import torch

    from shardmoe.tools.bench.candidates import _init_weights, _mixtral_block

    stack = [_mixtral_block(shape, _init_weights(shape, seed), dtype, torch.device("cpu")) for seed in range(layers)]
    x = torch.randn(1, shape.tokens, shape.hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
    saved, peak = _measure_stack(x.requires_grad_(), stack)
    per = shape.tokens * layers
    return {"saved": saved.total / per, "peak": peak / per}


def main(argv=None) -> int:
    import torch

    from shardmoe.tools.bench.flops import SHAPES, Shape

    parser = argparse.ArgumentParser(prog="python -m shardmoe.tools.bench.pool_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["e8", "fine"])
    parser.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--layers", nargs="+", type=int, default=list(LAYER_COUNTS))
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.layers):
        parser.error(f"--layers: expected counts >= 1, got {args.layers}")
    print("bytes per token per layer; footprint = pool + saved bytes outside the pool; peak = the step's peak "
          "allocation, pools counted whole; /tf = over transformers' saved bytes, or its peak")
    print(f"{'shape':6} {'dtype':5} {'layers':>6} {'pools':>9} {'saved':>8} {'pool':>8} {'footprint':>10} {'/tf':>6} "
          f"{'peak':>8} {'/tf':>6}")
    for name in args.shapes:
        for dtype_name in args.dtype:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            shape = Shape(*SHAPES[name])
            for layers in args.layers:
                tf = transformers_probe(shape, dtype, layers)
                print(f"{name:6} {dtype_name:5} {layers:>6} {'tf':>9} {tf['saved']:>8.0f} {'-':>8} {'-':>10} "
                      f"{1:>6.2f} {tf['peak']:>8.0f} {1:>6.2f}")
                for shared in (False, True):
                    r = probe(shape, dtype, layers, shared)
                    print(f"{name:6} {dtype_name:5} {layers:>6} {'shared' if shared else 'per layer':>9} "
                          f"{r['saved']:>8.0f} {r['pool']:>8.0f} {r['footprint']:>10.0f} "
                          f"{r['footprint'] / tf['saved']:>6.2f} {r['peak']:>8.0f} {r['peak'] / tf['peak']:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
