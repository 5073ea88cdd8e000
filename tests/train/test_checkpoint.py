"""Reading a checkpoint while another run replaces it: one consistent file, never a false 'corrupt'."""
import json
import os

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
