"""The distributed benchmark of the expert-parallel layer: `torchrun --nproc-per-node 4 -m shardmoe bench --mesh e=4`.

Every rank holds --tokens tokens (weak scaling: the work per rank stays fixed as ranks are
added) and runs forward + backward of one shardmoe.MoE layer on its shard of the mesh. Two
meshes are timed side by side, interleaved step by step on the same weights and tokens:
  p2p     the job's real topology (ranks_per_node = LOCAL_WORLD_SIZE): same-node peers exchange
          through the shared-memory heap;
  remote  every rank on a node of its own (ranks_per_node = 1): every peer through
          torch.distributed collectives.
Rank 0 prints, per path: tokens/s per rank (median step, slowest rank), the step time split
into route / dispatch / experts / combine (forward and backward together, slowest rank), the
bytes each rank sends to its peers per step against the least the routing needs (one copy of a
token's hidden vector per distinct destination rank, each way, forward and backward), and
whether both paths gave bit-identical outputs. Phase times include waiting for slower peers.
A transport line times the row exchange alone (S*k/G rows of H elements to every peer, the
dropless average), which isolates the two paths from the expert GEMMs.

Also runnable directly: `torchrun --nproc-per-node 4 -m shardmoe.tools.bench.distributed --mesh e=4`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from shardmoe.mesh import Mesh, parse_mesh
from shardmoe.moe.layer import MoE
from shardmoe.parallel.exchange import time_exchange
from shardmoe.parallel.expert_parallel import PHASES

DEFAULTS = dict(tokens=1024, hidden=256, ffn=512, experts=8, top_k=2, warmup=2, repeats=5)
QUICK = dict(tokens=128, hidden=64, ffn=128, warmup=1, repeats=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the distributed options; options the parser already has (shared with the single-process
    benchmark: --tokens, --dtype, --warmup, --repeats, --threads, --device, --json, --quick) are kept."""
    def add(flag, **kw):
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, **kw)

    add("--mesh", default=None, metavar="SPEC",
        help="distributed run under torchrun: mesh axes like 'e=4' or 'd=2,e=2,t=1' (unnamed axes are 1)")
    add("--tokens", type=int, default=None, help=f"tokens per rank (default {DEFAULTS['tokens']})")
    add("--hidden", type=int, default=None, help=f"hidden size H (default {DEFAULTS['hidden']})")
    add("--ffn", type=int, default=None, help=f"expert intermediate size F (default {DEFAULTS['ffn']})")
    add("--experts", type=int, default=None, help=f"experts E (default {DEFAULTS['experts']})")
    add("--top-k", type=int, default=None, help=f"experts per token k (default {DEFAULTS['top_k']})")
    add("--dtype", choices=("fp32", "bf16", "both"), default="fp32")
    add("--warmup", type=int, default=None, help=f"untimed steps (default {DEFAULTS['warmup']})")
    add("--repeats", type=int, default=None, help=f"timed steps per path (default {DEFAULTS['repeats']})")
    add("--threads", type=int, default=None, help="torch.set_num_threads per rank (default: torch's setting)")
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add("--json", metavar="PATH", default=None, help="rank 0 writes every number to this JSON file")
    add("--quick", action="store_true", help="tiny shapes and few steps (a smoke run)")


def _option(args, name: str):
    value = getattr(args, name, None)
    if value is None and getattr(args, "quick", False):
        value = QUICK.get(name)
    return DEFAULTS.get(name) if value is None else value


def run_distributed(args: argparse.Namespace) -> int:
    """Benchmark on the process group torchrun set up (or a one-rank group); rank 0 prints. Exit code."""
    own_group = not dist.is_initialized()
    if own_group:
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if getattr(args, "threads", None):
            torch.set_num_threads(args.threads)
        mesh_sizes = parse_mesh(args.mesh or f"e={dist.get_world_size()}")
        dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]
        reports = [_bench(args, mesh_sizes, name) for name in dtypes]
        if dist.get_rank() == 0:
            for report in reports:
                print(format_report(report))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(reports, f, indent=2)
        return 0
    finally:
        if own_group:
            dist.destroy_process_group()


def _bench(args, mesh_sizes: dict, dtype_name: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    S, H, F, E, k = (_option(args, n) for n in ("tokens", "hidden", "ffn", "experts", "top_k"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    sizes = (mesh_sizes["d"], mesh_sizes["e"], mesh_sizes["t"])
    # One rank has no peers: it runs the single-process MoE layer, the weak-scaling baseline.
    meshes = ({"p2p": Mesh(*sizes, ranks_per_node=local), "remote": Mesh(*sizes, ranks_per_node=1)}
              if world > 1 else {"local": Mesh(*sizes)})
    # With peers, every rank also runs the single-process layer on its own tokens, interleaved with
    # the paths: the anchor each path's step is divided by (what expert parallelism costs per rank).
    layer_meshes = {**meshes, "local": None} if world > 1 else meshes
    layers = {}
    for path, mesh in layer_meshes.items():
        torch.manual_seed(0)  # the same whole weights on every rank and for every path
        layers[path] = MoE(H, F, E, k, mesh=mesh, dtype=dtype, device=device)
    # Tokens differ per token-parallel rank and are alike along 't'.
    gen = torch.Generator().manual_seed(1000 + next(iter(meshes.values())).coord(("d", "e")))
    x = torch.randn(S, H, generator=gen).to(dtype=dtype, device=device)
    grad_out = torch.randn(S, H, generator=gen).to(dtype=dtype, device=device)

    steps = {path: [] for path in layers}
    outputs = {}
    for step in range(_option(args, "warmup") + _option(args, "repeats")):
        for path, layer in layers.items():  # interleaved: both paths see the same machine state
            dist.barrier()
            start = time.perf_counter()
            out = layer(x)
            out.backward(grad_out)
            elapsed = time.perf_counter() - start
            layer.zero_grad(set_to_none=True)
            outputs[path] = out.detach()
            if step >= _option(args, "warmup"):
                steps[path].append(dict(seconds=elapsed, phases=dict(layer.stats.get("seconds", {})),
                                        rows=dict(layer.stats.get("rows", {}))))
    identical = all(torch.equal(outputs[path], outputs[next(iter(meshes))]) for path in meshes)
    transport = {path: time_exchange(mesh, S * k, H * x.element_size(), _option(args, "repeats"))
                 for path, mesh in meshes.items() if mesh.size("e") > 1}
    mine = dict(rank=rank, steps=steps, identical=identical, transport=transport)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    shape = dict(tokens_per_rank=S, hidden=H, ffn=F, experts=E, top_k=k, dtype=dtype_name)
    return _summarise(gathered, shape, mesh_sizes, world, local, torch.get_num_threads(),
                      torch.empty((), dtype=dtype).element_size())


def _summarise(per_rank: list[dict], shape: dict, mesh_sizes: dict, world: int, local: int, threads: int,
               element_size: int) -> dict:
    """Per path: slowest-rank medians, bytes per rank per step and their minimum."""
    H, S = shape["hidden"], shape["tokens_per_rank"]
    acc_size = 4  # weights w and gate dots dw travel in float32 for fp32 and bf16
    paths = {}
    for path in per_rank[0]["steps"]:
        medians = [statistics.median(s["seconds"] for s in r["steps"][path]) for r in per_rank]
        slowest = max(medians)
        paths[path] = dict(step_s=slowest, tokens_per_s_per_rank=S / slowest)
        if not per_rank[0]["steps"][path][-1]["rows"]:
            continue  # the single-process layer: no phases, nothing sent
        phases = {p: max(statistics.median(s["phases"][p] for s in r["steps"][path]) for r in per_rank)
                  for p in PHASES}
        rows = [r["steps"][path][-1]["rows"] for r in per_rank]
        sent, least = [], []
        for r in rows:
            out_rows = r["p2p"] + r["remote"]  # dispatched to peers
            back_rows = r["received"] - r["self"]  # returned to peers by this rank's experts
            sent.append((out_rows + back_rows) * (2 * H * element_size + acc_size))
            least.append(4 * r["min_to_peers"] * H * element_size)
        paths[path].update(phases_s=phases, bytes_sent_per_rank=statistics.mean(sent),
                           bytes_min_per_rank=statistics.mean(least),
                           p2p_rows=sum(r["p2p"] for r in rows), remote_rows=sum(r["remote"] for r in rows))
        if per_rank[0]["transport"]:
            seconds = max(r["transport"][path] for r in per_rank)
            peers = mesh_sizes["e"]
            sent = (S * shape["top_k"] // peers) * (peers - 1) * H * element_size
            paths[path]["transport"] = dict(seconds=seconds, bytes_per_rank=sent)
    return dict(world=world, ranks_per_node=local, threads_per_rank=threads, mesh=mesh_sizes, shape=shape,
                paths=paths, bit_identical=all(r["identical"] for r in per_rank))


def format_report(report: dict) -> str:
    s, m = report["shape"], report["mesh"]
    lines = [
        f"shardmoe distributed bench: world {report['world']} (mesh d={m['d']} e={m['e']} t={m['t']}, "
        f"{report['ranks_per_node']} ranks per node, {report['threads_per_rank']} threads per rank), "
        f"{s['dtype']}, S={s['tokens_per_rank']} per rank, H={s['hidden']} F={s['ffn']} E={s['experts']} "
        f"k={s['top_k']}",
        f"{'path':<7} {'tok/s/rank':>10} {'step ms':>8} {'route':>7} {'dispatch':>9} {'experts':>8} {'combine':>8} "
        f"{'KB sent/rank':>13} {'KB min':>8} {'ratio':>6}",
    ]
    for path, p in report["paths"].items():
        head = f"{path:<7} {p['tokens_per_s_per_rank']:>10.0f} {1e3 * p['step_s']:>8.1f}"
        if "phases_s" not in p:
            lines.append(head + f" {'-':>7} {'-':>9} {'-':>8} {'-':>8} {0:>13.1f} {0:>8.1f} {'-':>6}")
            continue
        ph = p["phases_s"]
        ratio = f"{p['bytes_sent_per_rank'] / p['bytes_min_per_rank']:.2f}" if p["bytes_min_per_rank"] else "-"
        lines.append(
            head + f" {1e3 * ph['route']:>7.1f} {1e3 * ph['dispatch']:>9.1f} {1e3 * ph['experts']:>8.1f} "
            f"{1e3 * ph['combine']:>8.1f} {p['bytes_sent_per_rank'] / 1024:>13.1f} "
            f"{p['bytes_min_per_rank'] / 1024:>8.1f} {ratio:>6}")
    for path, p in report["paths"].items():
        if "transport" in p:
            t = p["transport"]
            lines.append(f"transport {path:<6}: one exchange of {t['bytes_per_rank'] / 2**20:.2f} MiB per rank to its "
                         f"peers in {1e3 * t['seconds']:.1f} ms ({t['bytes_per_rank'] / 2**20 / t['seconds']:.0f} MiB/s "
                         "per rank, slowest rank)")
    paths = report["paths"]
    if "local" in paths and len(paths) > 1:
        ratios = ", ".join(f"{path} {p['step_s'] / paths['local']['step_s']:.2f}" for path, p in paths.items()
                           if path != "local")
        lines.append(f"step / local (the single-process layer on each rank's tokens, all ranks at once, "
                     f"interleaved): {ratios}")
        lines.append(f"p2p and remote outputs bit-identical: {report['bit_identical']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardmoe.tools.bench.distributed", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_distributed(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
