"""Shared fixtures of the training tests: a tiny config and single-threaded torch."""
import pytest
import torch

from shardmoe.model.transformer import TransformerConfig
from shardmoe.train.config import TrainConfig

# vocab 260 (the 257 byte ids padded to a multiple of 4) splits over t = 2 and 4
TINY_MODEL = TransformerConfig(vocab_size=260, d_model=16, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4,
                               ffn_size=8, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001)


def tiny_train_config(**changes) -> TrainConfig:
    settings = dict(model=TINY_MODEL, steps=6, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2,
                    eval_batches=1, checkpoint_every=0, health_every=3, sample_bytes=8)
    return TrainConfig(**{**settings, **changes})


@pytest.fixture
def tiny_config():
    return tiny_train_config


@pytest.fixture
def one_thread():
    """Runs the test on one torch thread (as the training command does) and restores the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
