"""Checkpoints: one safetensors file with the FULL (unsharded) training state, written atomically.

    DIR/checkpoint.safetensors
      tensors   model.<param>                  full weights (the model's dtype)
                optim.exp_avg.<param>          AdamW first moments, full
                optim.exp_avg_sq.<param>       AdamW second moments, full
                model.<block>.moe.correction_bias   each router's correction bias (float32), when
                                               the model has them
                buffer.<name>                  any other persistent buffer (state that is not trained
                                               by gradient); replicated, so rank 0's copy is every rank's
                rng.torch                      torch's CPU generator state (uint8)
                rng.cuda                       the CUDA generator state of the run's GPU (uint8),
                                               when it ran on one
      metadata  format      "shardmoe-checkpoint/2"
                checksums   {tensor name: sha256 of its bytes} as JSON
                step        optimizer steps taken (the run resumes at step + 1)
                config      the TrainConfig as JSON (model table included)
                identity    the settings a resume must share (TrainConfig.resume_identity) as JSON;
                            the architecture preset `arch` among them
                data        the batch stream's state_dict as JSON

Tensors are written from host memory whatever device the run computes on, and read into host
memory (the map_location of a load is the CPU) and copied into the model's and the optimizer's
tensors on their device: a run saved on a GPU resumes on the CPU and the reverse. The CUDA
generator's state is restored when the resuming run computes on a GPU and the file has one (the
samples draw from the CPU generator: on either device a resume samples the same text).

Weights and moments are gathered whole, so a checkpoint does not depend on the mesh: a run saved
on d=2 x e=2 resumes on one process and vice versa. On a pipelined mesh each stage gathers its
own blocks' tensors and rank 0 collects the others' from its pipeline peers (the names are the
whole model's, so the file is the same whichever pipeline layout wrote it); a load keeps the
tensors of the part a rank holds. Rank 0 writes DIR/checkpoint.safetensors.tmp
and then os.replace()s it over the old file: a crash mid-write leaves the previous checkpoint
intact. Gathering is collective: every rank calls save_checkpoint.

Several ranks write sharded checkpoints instead (TrainConfig.checkpoint_format,
shardmoe/train/sharded_checkpoint.py: torch.distributed.checkpoint, nothing gathered) and this
single file once more at the run's last step, as its export. A resume reads the newest of the two
(latest_checkpoint); check_resumable and load_checkpoint take either.

Integrity: loading reads the whole file and compares every tensor's sha256 with the stored one
before any weight is used; a flipped byte raises ValueError naming the file and the tensor (a
corrupt header already fails to parse). Format 1 files carry no checksums and are refused.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from shardmoe.model.transformer import Transformer, TransformerConfig, full_shapes
from shardmoe.notation import MESH_AXES
from shardmoe.train.presets import DEFAULT_ARCH
from shardmoe.train.tokenizer import BYTE

from . import sharded_checkpoint
from .config import with_current_names
from .device import restore_rng_states, rng_states
from .optim import AdamW

FILE_NAME = "checkpoint.safetensors"
FORMAT = "shardmoe-checkpoint/2"
MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpoint_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / FILE_NAME


def latest_checkpoint(out_dir: str | Path) -> Path:
    """The checkpoint a resume of DIR reads: the newer (by step) of DIR/checkpoint.safetensors and the
    sharded checkpoint DIR/checkpoint.dcp/LATEST names; on a tie (a sharded run's last step writes
    both, with the same state) the sharded one. The file's path when DIR holds neither (so that
    check_resumable names it). ValueError when one of them is unreadable."""
    single, sharded = checkpoint_path(out_dir), sharded_checkpoint.latest(out_dir)
    if sharded is None:
        return single
    if not single.is_file():
        return sharded
    single_step = int(read_metadata(single)["step"])
    return single if single_step > int(sharded_checkpoint.read_metadata(sharded)["step"]) else sharded


def save_checkpoint(out_dir: str | Path, model: Transformer, optimizer: AdamW, step: int, config: dict,
                    identity: dict, data_state: dict, write: bool) -> None:
    """Gather the state (collective) and, when `write` (rank 0), write it atomically."""
    tensors = {f"model.{name}": t for name, t in model.full_state_dict().items()}
    tensors.update({f"buffer.{name}": b.detach().clone() for name, b in persistent_buffers(model).items()})
    with torch.no_grad():
        for key in MOMENTS:
            for name, local in optimizer.state_dict()[key].items():
                tensors[f"optim.{key}.{name}"] = model.gather_full(name, local).clone()
    mesh = model.mesh
    sends = mesh is not None and mesh.pipeline_size > 1 and mesh.coord(MESH_AXES) == 0
    if not (write or sends):
        return
    tensors = _from_every_stage({k: v.cpu() for k, v in tensors.items()}, mesh, write)  # host memory, pickled
    if not write:
        return
    tensors.update(rng_states(model.device))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    checksums = {name: tensor_checksum(t) for name, t in tensors.items()}
    metadata = {"format": FORMAT, "checksums": json.dumps(checksums, sort_keys=True), "step": str(step),
                "config": json.dumps(config),
                "identity": json.dumps(identity, sort_keys=True), "data": json.dumps(data_state)}
    path = checkpoint_path(out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
    except SafetensorError as err:  # a full disk, say: safetensors' own error type, which names no file
        kept = f"{path} keeps the previous one" if path.exists() else "no earlier checkpoint"
        raise OSError(f"cannot write the checkpoint {tmp}: {str(err).strip().splitlines()[0]}; {kept}") from None
    os.replace(tmp, path)


def _from_every_stage(tensors: dict[str, torch.Tensor], mesh, write: bool) -> dict[str, torch.Tensor]:
    """On a pipelined mesh, the writing rank's tensors joined with its pipeline peers' (each stage's
    first rank holds its stage's whole tensors: a gather over rank 0's pipeline group); else, and on
    every other rank, `tensors`."""
    if mesh is None or mesh.pipeline_size == 1 or mesh.coord(MESH_AXES) != 0:
        return tensors
    parts = [None] * mesh.pipeline_size if write else None
    dist.gather_object(tensors, parts, dst=mesh.pipeline_ranks[0], group=mesh.pipeline_group)
    return {name: t for part in parts for name, t in part.items()} if write else tensors


def persistent_buffers(model: Transformer) -> dict[str, torch.Tensor]:
    """The buffers in the model's state_dict that its full state dict does not already carry (the
    correction biases travel as model.<name>), by name: none is dropped silently."""
    carried = set(full_shapes(model.config))
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in carried}


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a contiguous tensor's bytes, as stored in the file."""
    return hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def read_metadata(path: str | Path) -> dict:
    """The checkpoint's metadata (reads only the file header); raises ValueError if unreadable."""
    return _read(path, tensors=False)[1]


def _read(path: str | Path, tensors: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors if asked, metadata) through one open file: a run writing this directory replaces
    the file atomically (os.replace), and a second open could pair one checkpoint's checksums with
    the next one's tensors. Raises ValueError if unreadable or of another format."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            read = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"checkpoint {path}: not a readable safetensors file ({err})") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    return read, metadata


def read_verified(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of the checkpoint at `path` once every tensor matches its stored checksum;
    otherwise ValueError naming the file and the first tensor that does not."""
    tensors, metadata = _read(path, tensors=True)
    stored = json.loads(metadata["checksums"])
    if set(stored) != set(tensors):
        raise ValueError(f"checkpoint {path}: corrupt: tensors {sorted(set(stored) ^ set(tensors))} "
                         "are in the file or in its checksum list but not both")
    for name, tensor in tensors.items():
        actual = tensor_checksum(tensor.contiguous())
        if actual != stored[name]:
            raise ValueError(f"checkpoint {path}: corrupt: tensor {name!r} has sha256 {actual[:16]}..., "
                             f"its checksum says {stored[name][:16]}...")
    return tensors, metadata


def checkpoint_step(path: str | Path) -> int:
    """The step of the checkpoint at `path`, either format (its header only)."""
    path = Path(path)
    return int((sharded_checkpoint.read_metadata(path) if path.is_dir() else read_metadata(path))["step"])


def saved_data_state(path: str | Path) -> dict:
    """The batch stream's state_dict the checkpoint at `path` saved, either format (its header only)."""
    path = Path(path)
    return sharded_checkpoint.read_metadata(path)["data"] if path.is_dir() else json.loads(read_metadata(path)["data"])


def check_resumable(path: str | Path, identity: dict, option: str = "--resume") -> int:
    """Raise ValueError (naming `option`, what gave the run) unless the checkpoint at `path` is
    intact (every checksum) and was written with the same identity settings; returns its step.
    Needs no process group, so a launcher calls it before creating one."""
    path = Path(path)
    if path.is_dir():  # a sharded checkpoint's step directory
        metadata = sharded_checkpoint.read_verified(path)
        saved = metadata["identity"]
    elif path.is_file():
        _, metadata = read_verified(path)
        saved = json.loads(metadata["identity"])
    else:
        raise ValueError(f"{option}: no checkpoint at {path} (nor a sharded one in "
                         f"{sharded_checkpoint.checkpoint_root(path.parent)})")
    saved.setdefault("arch", DEFAULT_ARCH)  # written before presets existed: the defaults, i.e. mixtral
    saved = with_current_names(saved)
    saved.setdefault("tokenizer", BYTE)  # written before tokenizers could be chosen: bytes
    if isinstance(saved.get("model"), dict):
        # an option that joined the model after the checkpoint was written, at its default: an option
        # joins with the default that keeps the behaviour it did not have, which the run trained with
        saved["model"] = TransformerConfig.from_dict(saved["model"]).to_dict()
    differences = setting_differences(saved, json.loads(json.dumps(identity)))
    if differences:
        raise ValueError(f"{option}: checkpoint {path} was written with another config: "
                         + "; ".join(differences))
    return int(metadata["step"])


def load_checkpoint(path: str | Path, model: Transformer, optimizer: AdamW, mesh=None) -> tuple[int, dict]:
    """Load weights and optimizer moments (keeping this rank's shards, on the model's device) and the
    RNG states; returns (step, data state dict). The single file: every rank reads (and verifies) it
    into host memory itself, no communication; a sharded checkpoint's step directory:
    sharded_checkpoint.load (collective)."""
    if Path(path).is_dir():
        return sharded_checkpoint.load(path, model, optimizer, mesh)
    tensors, metadata = read_verified(path)
    buffers = persistent_buffers(model)
    saved = {k[len("buffer."):]: v for k, v in tensors.items() if k.startswith("buffer.") and
             model.part.holds(k[len("buffer."):])}
    in_file, in_model = ({n: list(t.shape) for n, t in d.items()} for d in (saved, buffers))
    if in_file != in_model:  # checked before anything is loaded
        raise ValueError(f"checkpoint {path}: buffers {in_file} in the file, the model has {in_model}")
    model.load_full_state_dict({k[len("model."):]: v for k, v in tensors.items()
                                if k.startswith("model.") and model.part.holds(k[len("model."):])})
    with torch.no_grad():
        for name, buffer in buffers.items():
            buffer.copy_(saved[name])
    state = {"step": int(metadata["step"])}
    for key in MOMENTS:
        prefix = f"optim.{key}."
        state[key] = {name: model.shard_full(name, tensors[prefix + name]) for name, _ in model.named_parameters()}
    optimizer.load_state_dict(state)
    restore_rng_states(tensors, model.device)
    return int(metadata["step"]), json.loads(metadata["data"])


def setting_differences(saved, current, prefix: str = "") -> list[str]:
    """'key: saved X, now Y' for every leaf that differs between two nested dicts."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += setting_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: saved {a!r}, now {b!r}")
    return out
