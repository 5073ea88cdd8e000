"""What the workspace costs in memory, per layer, with one pool per layer or one pool for all.

`python -m shardmoe.bench.pool_probe [--shapes e8 fine] [--dtype fp32 bf16] [--layers 1 4 16]`
stacks L layers (t = t + MoE(t), the bench's shapes, dropless), runs one forward + backward, and
prints per token and per layer:
  saved      bytes a forward keeps for its backward (saved_bytes.measure_saved_bytes, input counted)
  pool       the workspace's resident bytes after the step: the step's peak of pooled buffers
             (every block is free again then, and kept for the next step)
  footprint  pool + the saved bytes that live outside the pool: what the layer holds for its
             backward and its scratch together, the figure issue 9 asks to count honestly
and transformers' saved bytes per token for the same block (its scratch buffers are not counted:
autograd frees them and the allocator may keep them, which no hook sees). Memory only, no timing:
the figures are exact for the shapes and do not depend on the machine's load.
"""
from __future__ import annotations

import argparse

LAYER_COUNTS = (1, 4, 16)


def probe(shape, dtype, layers: int, shared: bool) -> dict[str, float]:
    """{saved, pool, footprint} in bytes per token per layer for `layers` stacked layers."""
    import torch

    import shardmoe
    from shardmoe.bench.saved_bytes import measure_saved_bytes
    from shardmoe.moe.workspace import share

    torch.manual_seed(0)
    stack = [shardmoe.MoE(shape.hidden, shape.ffn, shape.experts, shape.top_k, dtype=dtype) for _ in range(layers)]
    if shared:
        share(stack)
    x = torch.randn(shape.tokens, shape.hidden, dtype=dtype, requires_grad=True)
    params = [p for layer in stack for p in layer.parameters()]

    def forward():
        t = x
        for layer in stack:
            t = t + layer(t)
        return t

    pools = list({id(layer.workspace): layer.workspace for layer in stack}.values())
    forward().sum().backward()  # the first step sizes the pools
    saved, out = measure_saved_bytes(forward, params, [x])
    in_pool = saved.in_pools(pools)
    out.sum().backward()
    per = shape.tokens * layers
    resident = sum(pool.resident_bytes for pool in pools)
    return {"saved": saved.total / per, "pool": resident / per, "footprint": (resident + saved.total - in_pool) / per}


def transformers_saved(shape, dtype) -> float:
    """transformers' Mixtral block: saved bytes per token (the bench's figure)."""
    import torch

    from shardmoe.bench.candidates import build_candidates
    from shardmoe.bench.saved_bytes import measure_saved_bytes

    cands, inputs = build_candidates(shape, dtype, torch.device("cpu"), ["transformers"])
    saved, _ = measure_saved_bytes(cands["transformers"].forward, cands["transformers"].params,
                                   (inputs["transformers"],))
    return saved.total / shape.tokens


def main(argv=None) -> int:
    import torch

    from shardmoe.bench.flops import SHAPES, Shape

    parser = argparse.ArgumentParser(prog="python -m shardmoe.bench.pool_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["e8", "fine"])
    parser.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--layers", nargs="+", type=int, default=list(LAYER_COUNTS))
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.layers):
        parser.error(f"--layers: expected counts >= 1, got {args.layers}")
    print("bytes per token per layer; footprint = pool + saved bytes outside the pool; /tf = over transformers' saved")
    print(f"{'shape':6} {'dtype':5} {'layers':>6} {'pools':>9} {'saved':>8} {'pool':>8} {'footprint':>10} {'/tf':>6}")
    for name in args.shapes:
        for dtype_name in args.dtype:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            shape = Shape(*SHAPES[name])
            tf = transformers_saved(shape, dtype)
            print(f"{name:6} {dtype_name:5} {'-':>6} {'tf':>9} {tf:>8.0f} {'-':>8} {'-':>10} {1:>6.2f}")
            for layers in args.layers:
                for shared in (False, True):
                    r = probe(shape, dtype, layers, shared)
                    print(f"{name:6} {dtype_name:5} {layers:>6} {'shared' if shared else 'per layer':>9} "
                          f"{r['saved']:>8.0f} {r['pool']:>8.0f} {r['footprint']:>10.0f} {r['footprint'] / tf:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
