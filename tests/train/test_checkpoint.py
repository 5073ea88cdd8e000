"""Reading a checkpoint while another run replaces it: one consistent file, never a false 'corrupt'."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from shardmoe.train import checkpoint as ckpt


def _write(path, value: float):
    tensors = {"w": torch.full((4,), value)}
    metadata = {"format": ckpt.FORMAT, "checksums": json.dumps({"w": ckpt.tensor_checksum(tensors["w"])})}
    save_file(tensors, str(path), metadata=metadata)


def test_read_verified_sees_one_checkpoint_while_the_file_is_replaced(tmp_path, monkeypatch):
    """The writer's os.replace lands right after the reader opened the file: the reader still gets
    the checkpoint it opened, header and tensors alike (two opens paired one file's checksums with
    the next file's tensors and reported it corrupt)."""
    path, newer = tmp_path / ckpt.FILE_NAME, tmp_path / "next.safetensors"
    _write(path, 1.0)
    _write(newer, 2.0)
    real_open = ckpt.safe_open

    def open_then_replace(*args, **kwargs):
        handle = real_open(*args, **kwargs)
        if newer.exists():
            os.replace(newer, path)  # the concurrent run's atomic write
        return handle

    monkeypatch.setattr(ckpt, "safe_open", open_then_replace)
    tensors, _ = ckpt.read_verified(path)
    assert torch.equal(tensors["w"], torch.full((4,), 1.0))
    tensors, _ = ckpt.read_verified(path)  # and the next read gets the new one whole
    assert torch.equal(tensors["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize("checkpoint_format", ["safetensors", "dcp"])
def test_a_checkpoint_of_a_gpu_run_resumes_on_another_device_bitwise(tmp_path, tiny_config, one_thread,
                                                                    checkpoint_format):
    """A checkpoint holds host tensors and each device's generator: a run on a GPU adds its CUDA
    generator's state (rng.cuda in the file, rng_cuda in a sharded one's shardmoe.json). Such a
    checkpoint, made here from a CPU run's by adding what rng_states writes on a GPU, resumes on the
    CPU to the uninterrupted run's losses and samples bit for bit (the CPU generator restored, the
    GPU's left alone); the single file loads into a model and optimizer on another device (meta):
    the load copies the host tensors into the model's own device. (A sharded checkpoint is read by
    DCP in place into the model's tensors, on whichever device they are.)"""
    from shardmoe.model.transformer import Transformer
    from shardmoe.train import sharded_checkpoint
    from shardmoe.train.loop import train
    from shardmoe.train.optim import AdamW
    from shardmoe.train.sample import read_samples

    from .test_loop import EXACT_KEYS

    config = tiny_config(steps=4, checkpoint_format=checkpoint_format, sample_every=1)
    whole = train(config, tmp_path / "whole", progress=False)
    train(config, tmp_path / "split", stop_after=2, progress=False)
    gpu_state = torch.arange(16, dtype=torch.uint8)
    path = ckpt.latest_checkpoint(tmp_path / "split")
    if checkpoint_format == "dcp":
        meta_file = path / sharded_checkpoint.META_FILE
        meta = json.loads(meta_file.read_text())
        meta_file.write_text(json.dumps({**meta, "rng_cuda": gpu_state.numpy().tobytes().hex()}))
    else:
        tensors, metadata = ckpt.read_verified(path)
        tensors["rng.cuda"] = gpu_state
        checksums = {name: ckpt.tensor_checksum(t) for name, t in tensors.items()}
        save_file(tensors, str(path), metadata={**metadata, "checksums": json.dumps(checksums, sort_keys=True)})
    resumed = train(config, tmp_path / "split", resume=True, progress=False)
    assert [{k: r[k] for k in EXACT_KEYS} for r in resumed.metrics] == \
        [{k: r[k] for k in EXACT_KEYS} for r in whole.metrics]
    assert read_samples(tmp_path / "split", up_to=4) == read_samples(tmp_path / "whole", up_to=4)
    if checkpoint_format == "dcp":
        return
    meta = torch.device("meta")
    model = Transformer(config.model, seed=config.seed, device=meta)
    optimizer = AdamW(model.named_parameters(), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "split"), model, optimizer)[0] == 4
    assert {t.device for t in [*model.parameters(), *optimizer.exp_avg.values()]} == {meta}
