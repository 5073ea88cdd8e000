"""What the cross-rank checks cost an expert-parallel training step, as fractions of the step.

    python benchmarks/consistency_cost.py [--ranks 2] [--tokens 1024] [--hidden 256] [--ffn 512]
                                          [--experts 8] [--repeats 20]

Spawns a local gloo world of --ranks processes (one thread each), ep = ranks, and times side by
side, interleaved round by round on the same layer:
  step         forward + backward of one shardmoe.MoE layer on this rank's tokens, then sync_grads
               (the parallel bench's default shape, fp32)
  handshake    one consistency.handshake: a step makes three (forward, backward, sync_grads)
  checks       the replica checks run every consistency.REPLICA_CHECK_EVERY steps: the layer's
               agreement check (settings and router checksums) and sync_grads' check_replicas
Prints the medians (slowest rank) and the per-step shares: 3 handshakes / step, and
checks / REPLICA_CHECK_EVERY / step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
    return float(elapsed)


def _measure(args) -> dict:
    import shardmoe
    from shardmoe.mesh import Mesh
    from shardmoe.moe.composition import compute_views
    from shardmoe.parallel import consistency, sync_grads
    from shardmoe.parallel.sync import check_replicas

    torch.set_num_threads(1)
    mesh = Mesh(ep=args.ranks)
    torch.manual_seed(0)
    layer = shardmoe.MoE(args.hidden, args.ffn, args.experts, 2, mesh=mesh, aux_loss_coef=0.01)
    x = torch.randn(args.tokens, args.hidden)

    def step():
        layer.zero_grad()
        layer(x).sum().backward()
        sync_grads(layer, mesh)

    def checks():
        gate_weight, gate_bias, *_ = compute_views(layer)
        layer.dispatcher.check_agreement(x.dtype, gate_weight.detach(), gate_bias, layer.correction_bias)
        check_replicas(layer, mesh)

    def handshake():  # sync_grads', naming the layer
        consistency.handshake(mesh, "sync_grads", [layer.dispatcher.number])

    work = {"step": step, "handshake": handshake, "checks": checks}
    for fn in work.values():  # warm-up
        fn()
    times = {name: [] for name in work}
    for _ in range(args.repeats):
        for name, fn in work.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from shardmoe.parallel import consistency
    from shardmoe.testing import run_distributed

    medians = run_distributed(_measure, args.ranks, args=(args,), timeout=600)[0]
    every = consistency.REPLICA_CHECK_EVERY
    print(f"ep={args.ranks} S={args.tokens}/rank H={args.hidden} F={args.ffn} E={args.experts} k=2 fp32, "
          f"{args.repeats} rounds, medians of the slowest rank")
    print(f"  step (forward + backward + sync_grads) {medians['step'] * 1e3:9.3f} ms")
    print(f"  one handshake                          {medians['handshake'] * 1e3:9.3f} ms   "
          f"3 per step: {3 * medians['handshake'] / medians['step']:.2%} of the step")
    print(f"  replica checks                         {medians['checks'] * 1e3:9.3f} ms   "
          f"every {every} steps: {medians['checks'] / every / medians['step']:.3%} of a step")


if __name__ == "__main__":
    main()
