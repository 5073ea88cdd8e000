"""`shardmoe trace --out DIR`: run one layer's forward and backward as tile tasks and write
forward.json, backward.json (Chrome trace, open in https://ui.perfetto.dev), forward.png,
backward.png (Gantt charts) and counts.json; print the task counts and the largest relative
difference from the MoE layer (float64 by default, where it is round-off)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardmoe.moe.config import ACTIVATIONS, EXPERT_KINDS
from shardmoe.tasks.plan import GATE_DEPENDENCIES
from shardmoe.tasks.schedulers import SCHEDULERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "The tile runtime and its schedule, and how these options shape them: docs/tasks.md."
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="directory for forward.json, backward.json (Chrome traces), forward.png, backward.png "
                             "(Gantt charts) and counts.json")
    layer = parser.add_argument_group("layer", "the one MoE layer run as tile tasks (shardmoe.MoE's options)")
    layer.add_argument("--tokens", type=int, default=64, metavar="S",
                       help="tokens of the input, S; 0 allowed (default %(default)s)")
    layer.add_argument("--hidden", type=int, default=16, metavar="H", help="hidden size, H (default %(default)s)")
    layer.add_argument("--ffn", type=int, default=32, metavar="F",
                       help="each expert's intermediate size: P for --expert mlp, F for glu (default %(default)s)")
    layer.add_argument("--experts", type=int, default=8, metavar="E",
                       help="number of experts, E (default %(default)s)")
    layer.add_argument("--top-k", type=int, default=2, metavar="K",
                       help="experts per token, 1..E (default %(default)s)")
    layer.add_argument("--expert", choices=EXPERT_KINDS, default="mlp",
                       help="mlp: W1, b1, act, W2, b2, act_out; glu: Mixtral's gate/up and down projections "
                            "(default %(default)s)")
    layer.add_argument("--activation", choices=ACTIVATIONS, default="silu",
                       help="the experts' activation (default %(default)s)")
    layer.add_argument("--output-activation", choices=ACTIVATIONS, default="identity",
                       help="activation after the second GEMM, --expert mlp only (default %(default)s)")
    layer.add_argument("--bias", action="store_true",
                       help="give the experts biases (mlp: b1, b2; glu: both projections; default none)")
    layer.add_argument("--capacity-factor", type=float, default=None, metavar="CF",
                       help="keep at most ceil(S/E * CF * k) pairs per expert, dropping the rest (default: "
                            "dropless)")
    layer.add_argument("--aux-loss-coef", type=float, default=0.0, metavar="C",
                       help="weight of the load-balancing loss, whose gradient gradGateGEMM adds (default "
                            "%(default)s)")
    layer.add_argument("--z-loss-coef", type=float, default=0.0, metavar="C",
                       help="weight of the router z-loss (default %(default)s)")
    layer.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                       help="the layer's dtype; the tile result must equal the MoE layer's within 1e-10 "
                            "(float64) or 1e-4 (float32), else exit 1 (default %(default)s)")
    run = parser.add_argument_group("schedule", "the simulated devices and how tasks are cut and picked")
    run.add_argument("--peers", type=int, default=4, metavar="N",
                     help="simulated devices, the experts split over them (default %(default)s)")
    run.add_argument("--ranks-per-node", type=int, default=2, metavar="N",
                     help="devices per node: peers on one node exchange by P2P stores, others by remote puts "
                          "(default %(default)s)")
    run.add_argument("--processors", type=int, default=4, metavar="N",
                     help="processors (task runners) per device (default %(default)s)")
    run.add_argument("--scheduler", choices=SCHEDULERS, default="random",
                     help="which ready task a free processor takes: the oldest (fifo), the newest (lifo), or a "
                          "random one, each duration stretched by a random factor (random) (default %(default)s)")
    run.add_argument("--seed", type=int, default=0,
                     help="seeds the inputs and the random scheduler (default %(default)s)")
    run.add_argument("--block-m", type=int, default=8, metavar="ROWS",
                     help="rows per row tile: an expert's rows on a device are cut into tiles of this many "
                          "(default %(default)s)")
    run.add_argument("--block-n", type=int, default=8, metavar="COLS",
                     help="columns per column tile of the GEMMs, over F and over H (default %(default)s)")
    run.add_argument("--gate-dependency", choices=GATE_DEPENDENCIES, default="token",
                     help="when gradGateGEMM may start: once every kept row of its tokens has had its "
                          "gradGateCombine (token), or once whole row tiles are done, FlashMoE's rule (row_tile) "
                          "(default %(default)s)")


def check_arguments(args: argparse.Namespace) -> None:
    """Every input error before any work: the layer's options (MoEConfig's checks), the schedule's
    sizes, --out."""
    from shardmoe.arguments import check_at_least, check_out_dir, check_seed
    from shardmoe.moe.config import MoEConfig

    MoEConfig(args.hidden, args.ffn, args.experts, args.top_k, expert=args.expert, activation=args.activation,
              output_activation=args.output_activation, bias=args.bias, capacity_factor=args.capacity_factor,
              aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef)
    check_at_least("--tokens", args.tokens, 0)
    for option in ("peers", "ranks_per_node", "processors", "block_m", "block_n"):
        check_at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    check_seed("--seed", args.seed)
    check_out_dir("--out", args.out)


def run(args: argparse.Namespace) -> int:
    import torch

    import shardmoe
    from shardmoe.check.compare import relative_error
    from shardmoe.tasks.api import run_backward, run_forward

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    layer = shardmoe.MoE(args.hidden, args.ffn, args.experts, args.top_k, expert=args.expert,
                         activation=args.activation, output_activation=args.output_activation, bias=args.bias,
                         capacity_factor=args.capacity_factor, aux_loss_coef=args.aux_loss_coef,
                         z_loss_coef=args.z_loss_coef, dtype=dtype)
    x = torch.randn(args.tokens, args.hidden, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(args.tokens, args.hidden, dtype=dtype)
    schedule = dict(peers=args.peers, ranks_per_node=args.ranks_per_node, processors=args.processors,
                    scheduler=args.scheduler, seed=args.seed, block_m=args.block_m, block_n=args.block_n)
    fwd = run_forward(layer, x, **schedule)
    bwd = run_backward(layer, x, grad_out, forward=fwd, gate_dependency=args.gate_dependency, **schedule)

    out = layer(x)
    params = dict(layer.named_parameters())
    want = torch.autograd.grad((out * grad_out).sum() + layer.aux_loss, [x, *params.values()])
    errors = {"output": relative_error(fwd.output, out), "grad_input": relative_error(bwd.grad_input, want[0])}
    errors.update({name: relative_error(bwd.grads[name], w) for name, w in zip(params, want[1:])})

    args.out.mkdir(parents=True, exist_ok=True)
    for name, result in (("forward", fwd), ("backward", bwd)):
        result.trace.save_json(args.out / f"{name}.json")
        result.trace.save_png(args.out / f"{name}.png")
    plan = fwd.plan
    summary = {"forward": fwd.counts, "backward": bwd.counts, "row_tiles": len(plan.row_tiles),
               "token_tiles": len(plan.token_tiles), "tN": plan.tn, "tNx": plan.tnx, "TCM": plan.tcm,
               "gtQCl": plan.gtqcl, "makespan": {"forward": fwd.trace.makespan, "backward": bwd.trace.makespan},
               "max_relative_error": errors}
    (args.out / "counts.json").write_text(json.dumps(summary, indent=2))
    print(f"row tiles {len(plan.row_tiles)}, token tiles {len(plan.token_tiles)}, tN={plan.tn}, tNx={plan.tnx}")
    for name, counts in (("forward", fwd.counts), ("backward", bwd.counts)):
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f"  (total {sum(counts.values())})")
    worst = max(errors.values())
    print(f"largest relative difference from the MoE layer: {worst:.2e}")
    print(f"wrote {args.out}/forward.json, backward.json, forward.png, backward.png, counts.json")
    tolerance = 1e-10 if dtype == torch.float64 else 1e-4
    return 0 if worst <= tolerance else 1
