"""AdamW, the learning-rate schedule and clipping against torch's own implementations."""
import math

import pytest
import torch

from shardmoe.train.optim import AdamW, clip_grads, global_grad_norm, learning_rate


def test_schedule_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    lr = [learning_rate(s, 1.0, warmup_steps=10, total_steps=110, min_ratio=0.1) for s in range(1, 131)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert lr[59] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # step 60: halfway
    assert lr[109] == pytest.approx(0.1) and lr[129] == pytest.approx(0.1)  # held at the floor
    assert all(a >= b for a, b in zip(lr[9:], lr[10:]))


def test_adamw_matches_torch_with_decay_on_matrices_only():
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (5, 3), "gain": (3,), "experts": (2, 3, 4)}
    ours = {n: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for n, s in shapes.items()}
    theirs = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ours.items()}
    opt = AdamW(ours.items(), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([{"params": [theirs["w"], theirs["experts"]], "weight_decay": 0.1},
                             {"params": [theirs["gain"]], "weight_decay": 0.0}], lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    for step in range(1, 6):
        lr = 1e-2 / step
        for name in shapes:
            grad = torch.randn(shapes[name], generator=gen, dtype=torch.float64)
            ours[name].grad, theirs[name].grad = grad.clone(), grad.clone()
        opt.step(lr)
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
    for name in shapes:
        assert torch.allclose(ours[name], theirs[name], rtol=0, atol=1e-14), name
    assert opt.state_dict()["step"] == 5


def test_clipping_matches_torch_clip_grad_norm():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 3, generator=gen) * 3, torch.randn(7, generator=gen)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0).item()
    norm = global_grad_norm([(g, 1) for g in grads])
    assert norm.dtype == torch.float64 and norm.shape == () and norm.item() == pytest.approx(expected_norm, rel=1e-6)
    clip_grads(grads, norm, max_norm=1.0)
    for g, p in zip(grads, params):
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=0)
    clipped = [g.clone() for g in grads]
    for within in (0.5, 1.0, float("nan"), float("inf")):  # under the limit, or not finite: untouched, bit for bit
        assert clip_grads(grads, torch.tensor(within, dtype=torch.float64), max_norm=1.0).item() == 1.0
        assert all(torch.equal(g, c) for g, c in zip(grads, clipped))


def test_replicated_shards_count_once_in_the_norm():
    # a 2-way replicated shard contributes half its square on each of its two ranks
    g = torch.tensor([3.0, 4.0])
    assert global_grad_norm([(g, 2)]).item() == pytest.approx(5.0 / math.sqrt(2))
