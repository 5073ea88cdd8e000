"""`shardmoe train`: train the MoE transformer on the embedded corpus or your own data.

    shardmoe train                                   # the default config, one process
    shardmoe train --arch mixtral                    # an architecture preset (shardmoe.train.presets)
    shardmoe train --data my.txt --out runs/mine     # a file, a directory or a glob of text/JSONL/Parquet
    shardmoe train --data docs/ --tokenizer tok/tokenizer.json   # a local Hugging Face tokenizer
    shardmoe train --steps 50 --out runs/short --seed 1
    shardmoe train --resume                          # continue runs/default with its settings
    shardmoe train --overwrite                       # start runs/default afresh, deleting the old run
    shardmoe train --device cuda --arch mixtral-1gpu # one GPU (--device auto, the default, takes one when present)
    torchrun --nproc-per-node 4 -m shardmoe train --mesh d=4 --arch mixtral-1gpu   # 4 GPUs: GPU LOCAL_RANK each, NCCL
    torchrun --nproc-per-node 4 -m shardmoe train --mesh d=2,e=2 --out runs/d2e2
    torchrun --nproc-per-node 4 -m shardmoe train --mesh p=2,e=2 --grad-accum-steps 2 --out runs/p2e2

Every configuration error (a mesh that cannot split the model, missing data or config file, an
unreadable tokenizer, a checkpoint written by another config or corrupt, a world size that is not
the mesh's, a setting given to --resume that differs from the run's, --steps below the
checkpoint's, data edited since it) is reported as one line, exit status 2, before any process
group exists; the data is tokenized into the token cache last (shardmoe.train.token_cache). On a
mesh the ranks then compare what each was given (rank_settings), and differing ranks stop alike
with one line, exit status 2. Rank 0 then claims the run directory (shardmoe.train.rundir: locked
against a second run, empty unless --resume or --overwrite), tells the other ranks the outcome,
and records the resolved settings in DIR/config.json (shardmoe.train.run_settings). A peer that
hangs or dies makes the others fail within --timeout-minutes with one line and exit status 1, as
does a failed write of the metrics or a checkpoint. Ctrl-C ends in one line naming the last
checkpoint and the command that resumes it (exit status 130). At the end rank 0 writes
DIR/loss_curve.png and DIR/expert_load.png (tokens per expert over the steps) and prints a
summary (the mean loss of the last SUMMARY_STEPS steps) and the last samples.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from pathlib import Path

from shardmoe.mesh import PIPELINE_MESH_AXES, parse_mesh
from shardmoe.model.residuals import BACKWARD_MODES
from shardmoe.model.transformer import CHECKPOINTING, check_layout
from shardmoe.parallel.pipeline import SCHEDULES, first_line, lost_peer
from shardmoe.train.config import TrainConfig, read_config_file
from shardmoe.train.device import DEVICES
from shardmoe.train.presets import ARCH_PRESETS, DEFAULT_ARCH, check_arch
from shardmoe.train.tokenizer import BYTE

DEFAULT_OUT = "runs/default"
MESH_AXIS_NAMES = {"p": "pp", "d": "dp", "e": "ep", "t": "tp"}
# the settings a flag of the same name (dashes for underscores) sets over the config file
FLAG_SETTINGS = ("arch", "steps", "seed", "backward", "timeout_minutes", "data", "tokenizer", "grad_accum_steps",
                 "pipeline_schedule", "stages_per_rank", "device", "activation_checkpointing")
SETTINGS_TABLE = 'docs/training.md, "Configuration"'
SUMMARY_STEPS = 50  # the summary's loss is the mean of this many last steps: one step's loss is noisy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (f"Every setting of a config file, with its type, default and meaning: {SETTINGS_TABLE}. "
                     "A flag overrides the file's setting of the same name.")
    parser.add_argument("--config", metavar="FILE",
                        help="JSON or TOML file of settings (a [model] table for the model); relative paths in it "
                             "are read from its folder")
    parser.add_argument("--arch", metavar="NAME",
                        help=f"architecture preset: {', '.join(ARCH_PRESETS)} (default: the config file's "
                             f"arch, else {DEFAULT_ARCH}); the config file's settings override it")
    parser.add_argument("--data", metavar="PATH",
                        help="training text: a file, a directory or a glob (.jsonl: a 'text' field per line, "
                             ".parquet: a 'text' column, anything else: plain text, documents separated by blank "
                             "lines); default: the embedded KJV corpus")
    parser.add_argument("--tokenizer", metavar="SPEC",
                        help="'byte' (default) or a local Hugging Face tokenizer: a tokenizer.json file or a "
                             "directory AutoTokenizer reads (nothing is downloaded); the model's vocabulary follows it")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="optimizer steps (also the cosine schedule's length; with --resume: move the run's end)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, metavar="S", help="seed of the initial weights and the data order")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in DIR from its newest checkpoint (checkpoint.safetensors or "
                             "checkpoint.dcp/) with its settings (DIR/config.json)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run in DIR even though it holds one (its files are deleted)")
    parser.add_argument("--mesh", default="", metavar="d=2,e=2",
                        help="mesh axis sizes (p pipeline, d data/FSDP, e expert, t tensor); launch with torchrun")
    parser.add_argument("--grad-accum-steps", type=int, metavar="N",
                        help="micro-batches per step, the update of the whole batch (default 1; a mesh with p > 1 "
                             "needs at least p for 1f1b)")
    parser.add_argument("--pipeline-schedule", choices=SCHEDULES,
                        help="how a mesh with p > 1 runs its stages over the grad_accum_steps micro-batches "
                             "(default 1f1b)")
    parser.add_argument("--stages-per-rank", type=int, metavar="V",
                        help="pipeline stages per rank (interleaved-1f1b: at least 2; the others: 1)")
    parser.add_argument("--backward", choices=BACKWARD_MODES, help="dense-layer backward (default explicit)")
    parser.add_argument("--device", choices=DEVICES,
                        help="where the run computes (default auto: a GPU when torch sees one, else the CPU); under "
                             "torchrun each rank takes GPU LOCAL_RANK and the ranks talk over NCCL (gloo on the CPU)")
    parser.add_argument("--activation-checkpointing", choices=CHECKPOINTING,
                        help="what the backward recomputes instead of keeping: none (default), moe (each block's MoE "
                             "layer) or block (whole blocks); the gradients are the same bit for bit")
    parser.add_argument("--timeout-minutes", type=float, metavar="M",
                        help="how long a rank waits for a hung or dead peer before failing "
                             f"(default {TrainConfig.timeout_minutes:g})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, list[str]]:
    """(the run's settings, lines to print about them). A new run: defaults < the preset (--arch,
    else the file's arch) < the config file < the other flags. --resume: the run's own settings
    (run_settings), which what is given again must match, but for --steps: the settings the file
    sets and the flags given, each as resolved (a path made absolute), and no setting the file
    leaves at its default."""
    from shardmoe.train.run_settings import resume_settings, stored_settings

    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite: expected at most one (continue the run in --out, or replace it)")
    flags = {name: getattr(args, name) for name in FLAG_SETTINGS if getattr(args, name) is not None}
    if "arch" in flags:
        check_arch(flags["arch"], "--arch")
    for name in ("data", "tokenizer"):  # a flag's relative path is the current directory's
        if name in flags and not (name == "tokenizer" and flags[name] == "byte"):
            flags[name] = os.path.abspath(os.path.expanduser(flags[name]))
    values = {}
    if args.config:
        values = read_config_file(args.config)
        try:  # the file's own errors, named by the file
            TrainConfig.from_dict({**values, **({"arch": flags["arch"]} if "arch" in flags else {})})
        except (ValueError, TypeError) as err:
            raise ValueError(f"--config {args.config}: {err}") from None
    given = TrainConfig.from_dict({**values, **flags})
    if not args.resume:
        return given, []
    resolved = given.to_dict()
    named = {key: resolved[key] for key in {**values, **flags} if key != "model"}
    if isinstance(values.get("model"), dict):
        named["model"] = {key: resolved["model"][key] for key in values["model"]}
    return resume_settings(stored_settings(args.out), named, args.out)


def check_memory(config: TrainConfig, device=None) -> None:
    """Raise ValueError when the model cannot fit in the memory of where it runs (this machine's, or
    the GPU's of a run on `device` a GPU): its parameters, their gradients and AdamW's two moments,
    each element stored once however the mesh shards it (a lower bound of a step's need; activations
    come on top). The parameters are counted from their shapes (full_shapes of one and two layers,
    the difference per layer), so nothing is built or allocated, however large the settings
    (model.vocab_size 1e8 was an out-of-memory traceback)."""
    import dataclasses

    import torch

    from shardmoe.model.transformer import full_shapes

    def count(n_layers: int) -> int:
        shapes = full_shapes(dataclasses.replace(config.model, n_layers=n_layers))
        return sum(math.prod(shape) for shape in shapes.values())

    params = count(1) + (config.model.n_layers - 1) * (count(2) - count(1))
    dtype = config.param_dtype
    need = params * 4 * torch.empty((), dtype=dtype).element_size()  # weights, gradients, two moments
    if device is not None and device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"GPU {device.index}'s"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's"
    if need > have:
        raise ValueError(f"model: expected a model that fits in {where} {have / 2**30:.1f} GiB, got "
                         f"{params:,} parameters needing at least {need / 2**30:.1f} GiB for weights, gradients and "
                         f"AdamW's two moments in {dtype}")


def validate_setup(config: TrainConfig, sizes: dict[str, int], world_size: int, out_dir: str, resume: bool,
                   overwrite: bool = False, progress: bool = False) -> tuple[tuple[Path, int] | None, str]:
    """Every check that needs no process group; raises ValueError with one clear message (the
    device among them: cuda without a GPU, a LOCAL_RANK past the node's GPUs). Tokenizes the data
    into the token cache if it is not there yet (a progress bar when `progress`). Returns
    ((checkpoint, step) a resume continues from, else None; the token cache's key of the data)."""
    from shardmoe.train.checkpoint import check_resumable, latest_checkpoint, saved_data_state
    from shardmoe.train.device import resolve_device
    from shardmoe.train.loop import build_streams
    from shardmoe.train.rundir import check_claimable

    from shardmoe.model.stages import stage_layers
    from shardmoe.parallel.pipeline import check_schedule

    check_layout(config.model, sizes["d"], sizes["e"], sizes["t"])
    device = resolve_device(config.device)
    token_shards = sizes["d"] * sizes["e"]
    if config.batch_size % token_shards:
        raise ValueError(f"batch_size: expected a multiple of d*e = {token_shards} (rows are split over d and e), "
                         f"got {config.batch_size}")
    if (config.batch_size // token_shards) % config.grad_accum_steps:
        raise ValueError(f"grad_accum_steps: expected a divisor of the {config.batch_size // token_shards} rows per "
                         f"rank (batch_size / (d*e)), got {config.grad_accum_steps}")
    if sizes["p"] > 1:
        check_schedule(config.pipeline_schedule, sizes["p"], config.stages_per_rank, config.grad_accum_steps)
        stage_layers(config.model.n_layers, sizes["p"] * config.stages_per_rank)
    check_memory(config, device)
    ranks = math.prod(sizes.values())
    if ranks != world_size:
        launch = f"torchrun --nproc-per-node {ranks} -m shardmoe train ..." if ranks > 1 else "one process"
        layout = ",".join(f"{a}={n}" for a, n in sizes.items() if a != "p" or n > 1)
        raise ValueError(f"--mesh {layout} needs {ranks} rank(s), but the world size is {world_size}: "
                         f"launch with {launch}")
    # before the checkpoint is read: a run writing out_dir may be replacing it right now
    check_claimable(out_dir, resume=resume, overwrite=overwrite)
    resume_from = None
    if resume:
        path = latest_checkpoint(out_dir)
        step = check_resumable(path, config.resume_identity())
        if config.steps < step:
            raise ValueError(f"--steps {config.steps}: expected at least the run's {step} steps taken (checkpoint "
                             f"{path}); a resumed run ends at or after its checkpoint")
        resume_from = path, step
    train_stream, _ = build_streams(config, progress=progress)  # missing, empty or too small data; the tokenizer
    if resume_from is not None:
        try:  # the data (or the tokenizer) edited under the same path since: another token stream
            train_stream.load_state_dict(saved_data_state(resume_from[0]))
        except ValueError as err:
            raise ValueError(f"--resume: the run's data or tokenizer changed since checkpoint {resume_from[0]} was "
                             f"written ({err}); resume on the data it trained on, or start a new run") from None
    return resume_from, train_stream.source


def run(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _run(args, rank)
    except KeyboardInterrupt:  # Ctrl-C (torchrun passes it to every rank): one line, from rank 0
        if rank == 0:
            print(f"shardmoe train: interrupted; {interrupted_run(args)}", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, rank: int) -> int:
    try:
        config, notes = resolve_config(args)
        sizes = parse_mesh(args.mesh, PIPELINE_MESH_AXES)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        resume_from, data_key = validate_setup(config, sizes, world_size, args.out, args.resume, args.overwrite,
                                               progress=rank == 0 and not args.no_progress)
    except ValueError as err:
        print(f"shardmoe train: {err}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an OSError

    from shardmoe.parallel.consistency import RankMismatchError
    from shardmoe.train.loop import TrainingDiverged

    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        mesh = _init_mesh(sizes, world_size, config.timeout_minutes, rank_settings(config, args, data_key),
                          config.device)
        try:
            lock = _claim_out(args, rank, mesh is not None)
            if lock is None:
                return 2
            try:
                if rank == 0:
                    _announce(config, args.out, notes, resume_from)
                return _train_and_report(config, args, mesh)
            finally:
                lock.release()
        finally:
            if mesh is not None:
                dist.destroy_process_group()
    except RankMismatchError as err:  # ranks given other settings than their peers (a stage's, say)
        print(f"shardmoe train: rank {rank}: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        if isinstance(err, TrainingDiverged):
            print(f"shardmoe train: rank {rank}: {err}", file=sys.stderr)
            return 1
        if not lost_peer(err):
            raise
        print(f"shardmoe train: rank {rank}: lost contact with the other ranks (a peer hung or died; "
              f"timeout_minutes={config.timeout_minutes:g}): {first_line(err)}", file=sys.stderr)
        return 1
    except OSError as err:  # a failed metrics or checkpoint write (it names the file)
        print(f"shardmoe train: rank {rank}: {first_line(err)}", file=sys.stderr)
        return 1
    except CheckpointException as err:  # a failed DCP write or read
        print(f"shardmoe train: rank {rank}: {checkpoint_failure(err)}", file=sys.stderr)
        return 1


def interrupted_run(args: argparse.Namespace) -> str:
    """What an interrupted run leaves and how to go on: the newest checkpoint in --out and the
    command that continues from it, or that there is none yet."""
    import shlex

    from shardmoe.train.checkpoint import checkpoint_step, latest_checkpoint

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    launch = f"torchrun --nproc-per-node {world_size} -m shardmoe train --mesh {shlex.quote(args.mesh)}" \
        if world_size > 1 else "shardmoe train"
    out = shlex.quote(args.out)
    try:
        path = latest_checkpoint(args.out)
        step = checkpoint_step(path) if path.exists() else None
    except ValueError as err:  # a checkpoint the interrupt left half-written is named by the resume
        return f"the checkpoints in {args.out} do not read ({err})"
    if step is None:
        return f"{args.out} holds no checkpoint yet; start again with: {launch} --out {out} --overwrite ..."
    return f"the last checkpoint is {path} at step {step}; continue with: {launch} --out {out} --resume"


def rank_settings(config: TrainConfig, args: argparse.Namespace, data_key: str) -> dict:
    """What every rank of a run must share, by name: its --mesh and --resume, every setting (the
    model's as model.NAME) but threads, each rank's own, and the paths, which may differ between
    nodes, and instead of them the token cache's key (the data's and the tokenizer's content)."""
    from shardmoe.train.config import PATH_SETTINGS

    settings = {"--mesh": parse_mesh(args.mesh, PIPELINE_MESH_AXES), "--resume": args.resume,
                "the data and tokenizer (their token cache key)": data_key}
    for name, value in config.to_dict().items():
        if name == "model":
            settings.update({f"model.{key}": v for key, v in value.items()})
        elif name not in PATH_SETTINGS and name != "threads":
            settings[name] = value
    return settings


def _init_mesh(sizes: dict[str, int], world_size: int, timeout_minutes: float, settings: dict, device_setting: str):
    """None on one process; else the process group (NCCL with this rank's GPU, LOCAL_RANK, made the
    current device when the run computes on GPUs; gloo on the CPU) and the Mesh of `sizes`, once
    every rank gave the same `settings` (rank_settings; RankMismatchError on every rank naming each
    that differs, before any rank builds groups from them)."""
    if world_size == 1:
        return None
    import torch
    import torch.distributed as dist

    from shardmoe.mesh import Mesh
    from shardmoe.parallel.pipeline import check_agreement
    from shardmoe.train.device import process_group_backend, resolve_device

    device = resolve_device(device_setting)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL, and every tensor made without an index, use this rank's GPU
    dist.init_process_group(process_group_backend(device), timeout=datetime.timedelta(minutes=timeout_minutes),
                            device_id=device if device.type == "cuda" else None)
    try:
        check_agreement(settings, "the run's settings", "every rank must be given the same config file and flags")
        return Mesh(**{MESH_AXIS_NAMES[a]: n for a, n in sizes.items()})
    except BaseException:
        dist.destroy_process_group()
        raise


def _claim_out(args: argparse.Namespace, rank: int, distributed: bool):
    """Rank 0 claims --out (shardmoe.train.rundir) and tells every rank whether it may go on.
    Returns the lock on rank 0, a no-op stand-in on the others, or None (after rank 0 printed why)."""
    from shardmoe.train.rundir import RunDirLock, claim_run_dir

    lock, refusal = RunDirLock(Path(args.out), -1), None
    if rank == 0:
        try:
            lock = claim_run_dir(args.out, resume=args.resume, overwrite=args.overwrite)
        except ValueError as err:
            refusal = str(err)
            print(f"shardmoe train: {refusal}", file=sys.stderr)
    if distributed:
        import torch.distributed as dist

        verdict = [refusal]
        dist.broadcast_object_list(verdict, src=0)
        refusal = verdict[0]
    return None if refusal is not None else lock


def _announce(config: TrainConfig, out: str, notes: list[str], resume_from: tuple[Path, int] | None) -> None:
    """Rank 0, once it holds --out: record the settings (DIR/config.json) and say what runs."""
    from shardmoe.train.run_settings import write_settings

    write_settings(out, config)
    for line in notes:
        print(line)
    if resume_from is not None:
        path, step = resume_from
        print(f"resuming {out} from {path} at step {step} of {config.steps}")


def checkpoint_failure(err) -> str:
    """One line for torch.distributed.checkpoint's CheckpointException: the error of each failed rank
    (its first line reads "CheckpointException ranks:dict_keys([0])", naming neither file nor cause)."""
    failures = getattr(err, "failures", None) or {}
    parts = [f"rank {r}: {type(e).__name__}: {e}" for r, (e, *_) in sorted(failures.items())
             if isinstance(e, BaseException)]
    return "sharded checkpoint: " + ("; ".join(parts) if parts else first_line(err))


def _train_and_report(config: TrainConfig, args: argparse.Namespace, mesh) -> int:
    from shardmoe.train.loop import train
    from shardmoe.train.metrics import throughput
    from shardmoe.train.plots import plot_expert_load, plot_loss_curve
    from shardmoe.train.rundir import CURVE_FILE, LOAD_FILE

    rank0 = mesh is None or mesh.rank == 0
    started = time.perf_counter()
    result = train(config, args.out, mesh=mesh, resume=args.resume, progress=not args.no_progress)
    wall = time.perf_counter() - started
    rows, new = result.metrics, result.new_metrics
    if not new:
        if rank0:
            print(f"nothing to train: {args.out} is already at step {result.start_step} of {config.steps}")
        return 0
    if not rank0:
        return 0
    model = config.model
    title = (f"shardmoe train --arch {config.arch}: {model.n_layers} layers, d_model {model.d_model}, "
             f"{model.moe.num_experts} experts (top {model.moe.top_k}), {config.steps} steps")
    unit = "byte" if config.tokenizer == BYTE else "token"
    curve = plot_loss_curve(rows, Path(args.out) / CURVE_FILE, title=title, unit=unit)
    load = plot_expert_load(rows, Path(args.out) / LOAD_FILE, title=title)
    tokens_per_s, mfu = throughput(new)
    final, tail = rows[-1], new[-SUMMARY_STEPS:]
    held_out = f"; held-out {final['val_loss']:.3f}" if "val_loss" in final else ""
    print(f"steps {new[0]['step']}..{final['step']}: loss (nats / {unit}) {new[0]['loss']:.3f} at step "
          f"{new[0]['step']}, mean {sum(r['loss'] for r in tail) / len(tail):.3f} over steps {tail[0]['step']}.."
          f"{final['step']} (last step {final['loss']:.3f}){held_out}; {wall:.0f} s wall, {tokens_per_s:.0f} tokens/s, "
          f"MFU {mfu:.1%} of {result.peak_source}")
    print(f"wrote {Path(args.out) / 'metrics.jsonl'}, {curve}, {load} and {Path(args.out) / 'checkpoint.safetensors'}")
    print(f"expert load, max/mean over the experts of the worst layer: step {new[0]['step']} "
          f"{new[0]['worst_load_max_over_mean']:.2f} -> step {final['step']} {final['worst_load_max_over_mean']:.2f}")
    if result.samples:
        print(f"samples at step {result.samples[0]['step']} (held-out prompt | continuation; all in "
              f"{Path(args.out) / 'samples.jsonl'}):")
        for row in result.samples:
            print(f"  {one_line(row['prompt'])} | {one_line(row['sample'])}")
    return 0


def one_line(text: str) -> str:
    """text on one line: newlines shown as ⏎, other control characters as U+FFFD."""
    return "".join("\u23ce" if c == "\n" else c if c.isprintable() else "\ufffd" for c in text)
