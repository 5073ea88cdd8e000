"""`shardmoe train`: train the MoE transformer on the embedded corpus (or a configured one).

    shardmoe train                                   # the default config, one process
    shardmoe train --steps 50 --out runs/short --seed 1
    shardmoe train --resume                          # continue runs/default from its checkpoint
    torchrun --nproc-per-node 4 -m shardmoe train --mesh d=2,e=2

Every configuration error (a mesh that cannot split the model, a missing corpus or config file,
a checkpoint written by another config, a world size that is not the mesh's) is reported as one
line before any process group exists. At the end rank 0 writes DIR/loss_curve.png and prints a
summary and a few sampled lines.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from shardmoe.mesh import parse_mesh
from shardmoe.model.residuals import BACKWARD_MODES
from shardmoe.model.transformer import check_layout
from shardmoe.train.config import TrainConfig, load_config

DEFAULT_OUT = "runs/default"
MESH_AXIS_NAMES = {"d": "dp", "e": "ep", "t": "tp"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="JSON or TOML file of settings (a [model] table for the model)")
    parser.add_argument("--steps", type=int, metavar="N", help="optimizer steps (also the cosine schedule's length)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, metavar="S", help="seed of the initial weights and the data order")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.safetensors")
    parser.add_argument("--mesh", default="", metavar="d=2,e=2",
                        help="mesh axis sizes (d data/FSDP, e expert, t tensor); launch with torchrun")
    parser.add_argument("--backward", choices=BACKWARD_MODES, help="dense-layer backward (default explicit)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    config = load_config(args.config) if args.config else TrainConfig()
    overrides = {k: getattr(args, k) for k in ("steps", "seed", "backward") if getattr(args, k) is not None}
    return config.replace(**overrides) if overrides else config


def validate_setup(config: TrainConfig, sizes: dict[str, int], world_size: int, out_dir: str, resume: bool) -> None:
    """Every check that needs no process group; raises ValueError with one clear message."""
    from shardmoe.train.checkpoint import check_resumable, checkpoint_path
    from shardmoe.train.loop import build_streams

    check_layout(config.model, sizes["d"], sizes["e"], sizes["t"])
    token_shards = sizes["d"] * sizes["e"]
    if config.batch_size % token_shards:
        raise ValueError(f"batch_size: expected a multiple of d*e = {token_shards} (rows are split over d and e), "
                         f"got {config.batch_size}")
    build_streams(config)  # a missing or too small corpus
    if resume:
        check_resumable(checkpoint_path(out_dir), config.resume_identity())
    ranks = sizes["d"] * sizes["e"] * sizes["t"]
    if ranks != world_size:
        launch = f"torchrun --nproc-per-node {ranks} -m shardmoe train ..." if ranks > 1 else "one process"
        raise ValueError(f"--mesh d={sizes['d']},e={sizes['e']},t={sizes['t']} needs {ranks} rank(s), but the "
                         f"world size is {world_size}: launch with {launch}")


def run(args: argparse.Namespace) -> int:
    try:
        config = resolve_config(args)
        sizes = parse_mesh(args.mesh)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        validate_setup(config, sizes, world_size, args.out, args.resume)
    except ValueError as err:
        print(f"shardmoe train: {err}", file=sys.stderr)
        return 2
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    mesh = _init_mesh(sizes, world_size)
    try:
        return _train_and_report(config, args, mesh)
    finally:
        if mesh is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _init_mesh(sizes: dict[str, int], world_size: int):
    if world_size == 1:
        return None
    import torch.distributed as dist

    from shardmoe.mesh import Mesh

    dist.init_process_group("gloo")
    return Mesh(**{MESH_AXIS_NAMES[a]: n for a, n in sizes.items()})


def _train_and_report(config: TrainConfig, args: argparse.Namespace, mesh) -> int:
    from shardmoe.train.loop import train
    from shardmoe.train.plots import plot_loss_curve
    from shardmoe.train.sample import DEFAULT_PROMPTS, sample

    rank0 = mesh is None or mesh.rank == 0
    started = time.perf_counter()
    result = train(config, args.out, mesh=mesh, resume=args.resume, progress=not args.no_progress)
    wall = time.perf_counter() - started
    rows, new = result.metrics, result.new_metrics
    if not new:
        if rank0:
            print(f"nothing to train: {args.out} is already at step {result.start_step} of {config.steps}")
        return 0
    # Collective under a mesh: every rank samples, rank 0 prints.
    samples = [sample(result.model, prompt, config.sample_bytes, seq_len=config.seq_len,
                      temperature=config.sample_temperature, seed=config.seed + i)
               for i, prompt in enumerate(DEFAULT_PROMPTS)] if config.sample_bytes else []
    if not rank0:
        return 0
    model = config.model
    curve = plot_loss_curve(rows, Path(args.out) / "loss_curve.png",
                            title=f"shardmoe train: {model.n_layers} layers, d_model {model.d_model}, "
                                  f"{model.num_experts} experts (top {model.top_k}), {config.steps} steps")
    tokens_per_s = len(new) * config.batch_size * config.seq_len / sum(r["seconds"] for r in new)
    mean_mfu = sum(r["mfu"] for r in new) / len(new)
    final = rows[-1]
    held_out = f", held-out {final['val_loss']:.3f}" if "val_loss" in final else ""
    print(f"steps {new[0]['step']}..{final['step']}: loss {new[0]['loss']:.3f} -> {final['loss']:.3f}{held_out}; "
          f"{wall:.0f} s wall, {tokens_per_s:.0f} tokens/s, mean MFU {mean_mfu:.1%} of a measured "
          f"{result.peak_flops / 1e9:.1f} GFLOP/s matmul peak per rank")
    print(f"wrote {Path(args.out) / 'metrics.jsonl'}, {curve} and {Path(args.out) / 'checkpoint.safetensors'}")
    if samples:
        print("samples:")
        for text in samples:  # one line each: sampling stops at a newline; control bytes are masked
            print("  " + "".join(c if c.isprintable() else "\ufffd" for c in text.rstrip("\n")))
    return 0
