"""The probe behind the row tile of tile-padded expert groups (shardmoe.moe.experts.row_tile).

`python -m shardmoe.bench.tile_probe [--threads N]` runs, for each (dtype, rows per expert),
the forward GEMM of every expert, h_e = x_e Wgu_e^T ([m_e, H] x [H, 2F]) into a reused buffer, as
the workspace path does, with each m_e drawn afresh every step (as fresh routing gives), and
each m_e rounded up to a multiple of the tile T (T = 0: exact counts). Tiles are interleaved
within one process; it prints each tile's median step time as a ratio to T = 0 (< 1: the tile
pays), since absolute times on a shared machine mean little.
"""
from __future__ import annotations

import argparse
import statistics
import time

TILES = (0, 8, 16, 32, 64, 128)
# (name, experts, rows per expert, hidden, 2F): e8's, fine's and e64's expert GEMMs
CASES = (("e8", 8, 1024, 512, 2048), ("fine", 64, 512, 512, 512), ("e64", 64, 128, 512, 256))


def _step(x, w, out, sizes, tile):
    import torch

    start = 0
    for e, m in enumerate(sizes):
        padded = -(-m // tile) * tile if tile else m
        torch.mm(x[start:start + padded], w[e], out=out[start:start + padded])
        start += m


def probe(dtype, experts, rows, hidden, width, steps, seed=0):
    """{tile: median seconds} of one step of every expert's GEMM, fresh counts every step."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    total = experts * rows
    x = torch.randn(total + max(TILES), hidden, generator=gen).to(dtype)
    w = (torch.randn(experts, hidden, width, generator=gen) / hidden ** 0.5).to(dtype)
    out = torch.empty(total + max(TILES), width, dtype=dtype)
    times = {t: [] for t in TILES}
    for step in range(steps):
        # multinomial counts around `rows` per expert, summing to `total`, new every step
        choice = torch.randint(0, experts, (total,), generator=gen)
        sizes = torch.bincount(choice, minlength=experts).tolist()
        order = TILES[step % len(TILES):] + TILES[:step % len(TILES)]
        for tile in order:
            t0 = time.perf_counter()
            _step(x, w, out, sizes, tile)
            times[tile].append(time.perf_counter() - t0)
    return {t: statistics.median(v) for t, v in times.items()}


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m shardmoe.bench.tile_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()}  median step time / T=0 (interleaved, fresh counts each step)")
    print(f"{'dtype':6} {'case':5} {'rows/e':>6} " + " ".join(f"T={t:<5}" for t in TILES))
    for dtype in (torch.bfloat16, torch.float32):
        for name, experts, rows, hidden, width in CASES:
            med = probe(dtype, experts, rows, hidden, width, args.steps)
            print(f"{str(dtype)[6:]:6} {name:5} {rows:6} " + " ".join(f"{med[t] / med[0]:<7.2f}" for t in TILES)
                  + f"  (T=0: {med[0] * 1e3:.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
