"""The sharded transformer under torch.autocast: float32 parameters and gradients, GEMMs in bf16
(the dense layers' explicit backwards run under the forward's autocast state, the MoE keeps its
router in float32); loss and every gradient within bf16 round-off of the float32 model, for both
backward modes."""
import pytest
import torch

from shardmoe.model.transformer import Transformer, TransformerConfig
from shardmoe.moe.config import MoEConfig

CONFIG = TransformerConfig(vocab_size=24, d_model=12, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=6,
                           moe=MoEConfig(12, 10, 4, 2, aux_loss_coef=0.05, z_loss_coef=0.01), rope_theta=100.0)


@pytest.mark.parametrize("backward", ["explicit", "autograd"])
def test_autocast_bf16_within_round_off_of_float32(backward):
    model = Transformer(CONFIG, backward=backward)
    gen = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 24, (2, 8), generator=gen), torch.randint(0, 24, (2, 8), generator=gen)
    starts = torch.zeros(2, 8, dtype=torch.bool)
    starts[:, 0] = True
    want_loss = model(ids, starts, targets).total
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, starts, targets).total
    loss.backward()
    assert abs(loss.item() - want_loss.item()) <= 1e-2 * abs(want_loss.item())
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, name
        rel = ((p.grad - want[name]).abs().max() / want[name].abs().max().clamp(min=1e-6)).item()
        assert rel <= 5e-2, (name, rel)
