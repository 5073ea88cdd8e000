"""Sharded checkpoints: torch.distributed.checkpoint (DCP), every rank writing its own shards.

    DIR/checkpoint.dcp/LATEST              the name of the newest complete step directory
    DIR/checkpoint.dcp/step_000020/        one checkpoint
        .metadata, __R_0.distcp            DCP's files: every block of every tensor once
          model.<param>                    the whole logical tensors (Transformer.whole_entry:
                                           DTensors over the mesh), persistent buffers as they are
          optim.exp_avg.<param>, optim.exp_avg_sq.<param>   AdamW's moments, laid out the same way
        shardmoe.json                      format, step, config, identity, the batch stream's
                                           state, rank 0's torch RNG states (rng; rng_cuda of a
                                           run on GPUs), and the sha256 of every DCP file of the
                                           directory

Nothing is gathered: a rank saves the blocks it holds and, on load, DCP reads the blocks that make
up its own shards, whatever layout wrote them, so a checkpoint of d=2 x e=2 resumes on one process
(into plain whole tensors) and one of one process on any mesh. On a pipelined mesh every rank of
the job takes part, each with its stage's entries, keyed by layer ("model.blocks.5..."): a
checkpoint written at p=2 loads at p=1 and the reverse. Loading is in place into the
model's parameters and the optimizer's moments (whole_entry shares their storage).

Atomicity: rank 0 writes shardmoe.json once DCP has written every rank's files (dcp.save returns on
rank 0 after every rank's writes are done), then points LATEST at the directory (os.replace), then
deletes older step directories, while the other ranks wait for its outcome (an error there is
raised on every rank); a crash leaves LATEST at
the previous complete checkpoint. Integrity:
check_resumable (before any process group) and load (rank 0, its verdict broadcast) compare every
file's sha256 with shardmoe.json before any weight is used, as the single-file checkpoint does. The directory must be on a filesystem every rank sees.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from shardmoe.model.transformer import Transformer
from shardmoe.notation import MESH_AXES

from .device import restore_rng_states, rng_states
from .optim import AdamW

DIR_NAME = "checkpoint.dcp"
LATEST = "LATEST"
META_FILE = "shardmoe.json"
FORMAT = "shardmoe-dcp/1"
MOMENTS = ("exp_avg", "exp_avg_sq")
RNG_KEYS = {"rng.torch": "rng", "rng.cuda": "rng_cuda"}  # device.rng_states' names -> shardmoe.json's keys


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / DIR_NAME


def _state(model: Transformer, optimizer: AdamW) -> dict:
    """What DCP saves and loads in place: the model's state dict and the moments, as whole tensors."""
    optim = optimizer.state_dict()
    return {"model": model.state_dict(),
            "optim": {key: {name: model.whole_entry(name, local) for name, local in optim[key].items()}
                      for key in MOMENTS}}


def _process_group(mesh):
    """Every rank of the job: the mesh's, or the world's on a pipelined mesh (each stage saves and
    loads its own blocks under the whole model's names)."""
    if mesh is None:
        return None
    return dist.group.WORLD if mesh.pipeline_size > 1 else mesh.group(MESH_AXES)


def save(out_dir: str | Path, model: Transformer, optimizer: AdamW, step: int, config: dict, identity: dict,
         data_state: dict, mesh) -> None:
    """Write step `step`'s checkpoint (collective: every rank of the mesh calls it). A failure of
    rank 0's own work (clearing the directory, writing shardmoe.json and LATEST) is raised on
    every rank as OSError, so no rank waits for it."""
    import torch.distributed.checkpoint as dcp

    rank = 0 if mesh is None else mesh.rank
    root = checkpoint_root(out_dir)
    path = root / f"step_{step:06d}"
    group = _process_group(mesh)

    def fresh_directory():
        if path.exists():
            shutil.rmtree(path)  # an incomplete directory of a run that crashed here
        path.mkdir(parents=True)

    _on_rank0_for_all(group, fresh_directory, "sharded checkpoint: ")  # no rank writes into the directory before it is fresh
    with torch.no_grad(), _one_process_is_intended():
        dcp.save(_state(model, optimizer), storage_writer=dcp.FileSystemWriter(str(path)), process_group=group,
                 no_dist=group is None)
    # each rank hashes the files it wrote (DCP names them __<rank>_<n>.distcp), rank 0 the rest
    checksums = {p.name: _file_checksum(p) for p in sorted(path.glob(f"__{rank}_*.distcp"))}
    if group is not None:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, checksums, group=group)
        checksums = {name: digest for part in parts for name, digest in part.items()}

    def complete():
        checksums.update({p.name: _file_checksum(p) for p in sorted(path.iterdir()) if p.name not in checksums})
        meta = {"format": FORMAT, "step": step, "config": config, "identity": identity, "data": data_state,
                "checksums": checksums, **{RNG_KEYS[name]: state.numpy().tobytes().hex()
                                           for name, state in rng_states(model.device).items()}}
        _write_atomically(path / META_FILE, json.dumps(meta, sort_keys=True))
        _write_atomically(root / LATEST, path.name)
        for old in root.iterdir():
            if old.is_dir() and old.name != path.name:
                shutil.rmtree(old, ignore_errors=True)  # superseded: LATEST no longer names it

    _on_rank0_for_all(group, complete, "sharded checkpoint: ")  # every rank returns with LATEST at a complete checkpoint


def _on_rank0_for_all(group, work, context: str = "") -> None:
    """Run `work` on rank 0 of `group` (the one process without one) and raise what it raised on
    every rank (a broadcast of the outcome in place of a barrier: the others neither hang nor report
    a lost peer): a ValueError as itself, an OSError with `context` in front, anything else as a
    RuntimeError naming its type (an error of any type must reach the others, who would otherwise
    wait in the broadcast until the timeout)."""
    outcome, cause = [None], None
    if group is None or dist.get_rank(group) == 0:
        try:
            work()
        except Exception as err:
            # the message, not the exception: not every exception pickles
            cause, outcome = err, [(type(err).__name__, isinstance(err, ValueError), isinstance(err, OSError), str(err))]
    if group is not None:
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
    if outcome[0] is not None:
        name, is_value_error, is_os_error, message = outcome[0]
        error = ValueError(message) if is_value_error else OSError(context + message) if is_os_error \
            else RuntimeError(f"{context}{name}: {message}")
        raise error from cause


def latest(out_dir: str | Path) -> Path | None:
    """The step directory LATEST names, or None when DIR holds no sharded checkpoint. Step
    directories without LATEST are refused by name: a resume must not fall back silently to the
    single file, which may be older (LATEST goes missing when a first save dies before writing it,
    or when it is deleted)."""
    pointer = checkpoint_root(out_dir) / LATEST
    if not pointer.is_file():
        steps = sorted(p.name for p in checkpoint_root(out_dir).glob("step_*")) if checkpoint_root(out_dir).is_dir() \
            else []
        if steps:
            raise ValueError(f"checkpoint {checkpoint_root(out_dir)}: holds {', '.join(steps)} but no {LATEST} naming "
                             f"the complete one; write the name of a complete step directory (with {META_FILE}) into "
                             f"{pointer}, or remove the step directories to resume from what else {out_dir} holds")
        return None
    path = checkpoint_root(out_dir) / pointer.read_text().strip()
    if not path.is_dir():
        raise ValueError(f"checkpoint {pointer}: names {path.name}, which is not a directory of "
                         f"{checkpoint_root(out_dir)}")
    return path


def read_metadata(path: str | Path) -> dict:
    """shardmoe.json of a step directory; ValueError if missing, unreadable or of another format."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"checkpoint {path}: no readable {META_FILE} ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"checkpoint {path}: format {found!r}, expected {FORMAT!r}")
    return meta


def read_verified(path: str | Path) -> dict:
    """The metadata once every DCP file of the directory matches its stored sha256; otherwise
    ValueError naming the directory and the first file that does not."""
    path = Path(path)
    meta = read_metadata(path)
    stored = meta["checksums"]
    present = {p.name for p in path.iterdir() if p.name != META_FILE}
    if present != set(stored):
        raise ValueError(f"checkpoint {path}: corrupt: files {sorted(present ^ set(stored))} are in the "
                         f"directory or in its checksum list but not both")
    for name in sorted(stored):
        actual = _file_checksum(path / name)
        if actual != stored[name]:
            raise ValueError(f"checkpoint {path}: corrupt: file {name!r} has sha256 {actual[:16]}..., its "
                             f"checksum says {stored[name][:16]}...")
    return meta


def load(path: str | Path, model: Transformer, optimizer: AdamW, mesh) -> tuple[int, dict]:
    """Load weights, buffers and moments in place (this rank's shards, from whatever layout wrote
    them) and rank 0's RNG state; returns (step, data state). Collective under a mesh. Rank 0
    first compares every file with its sha256 (read_verified) and every rank raises its
    ValueError, before anything is loaded."""
    import torch.distributed.checkpoint as dcp

    group = _process_group(mesh)
    _on_rank0_for_all(group, lambda: read_verified(path))
    meta = read_metadata(path)
    state = _state(model, optimizer)
    with torch.no_grad(), _one_process_is_intended():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), process_group=group, no_dist=group is None)
    model.load_state_dict(state["model"])  # in place already; this checks every key and shape
    optimizer.step_count = int(meta["step"])
    restore_rng_states({name: torch.frombuffer(bytearray.fromhex(meta[key]), dtype=torch.uint8).clone()
                        for name, key in RNG_KEYS.items() if key in meta}, model.device)
    return int(meta["step"]), meta["data"]


@contextlib.contextmanager
def _one_process_is_intended():
    """DCP warns that it assumes one process whenever no process group is initialised, even when
    told so (no_dist=True); a run on one process is exactly that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _file_checksum(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
