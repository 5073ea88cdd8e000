"""Routing: top-k, renormalisation, capacity in token order, balance losses, grad_gate_gemm."""
import math

import torch

from shardmoe.moe.config import MoEConfig
from shardmoe.moe.routing import balance_loss, dispatch_order, grad_gate_gemm, route


def _config(**kw):
    base = dict(hidden_size=6, ffn_size=4, num_experts=5, top_k=2)
    base.update(kw)
    return MoEConfig(**base)


def test_route_selects_top_k_and_renormalises():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 6, generator=gen, dtype=torch.float64)
    wg = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    r = route(x, wg, _config())
    probs = torch.softmax(x @ wg, -1)
    assert torch.allclose(r.probs, probs, rtol=1e-14)
    assert torch.equal(r.top_idx, probs.topk(2, -1).indices)
    assert torch.allclose(r.weight.sum(-1), torch.ones(11, dtype=torch.float64))
    r_raw = route(x, wg, _config(renormalize=False))
    assert torch.allclose(r_raw.weight, probs.topk(2, -1).values)


def test_bf16_routing_runs_in_float32():
    x = torch.randn(7, 6).bfloat16()
    r = route(x, torch.randn(6, 5).bfloat16(), _config())
    assert r.probs.dtype == torch.float32 and r.weight.dtype == torch.float32


def test_dispatch_order_groups_by_expert_in_token_order_and_drops_past_capacity():
    top_idx = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0]])
    rows, selected, kept = dispatch_order(top_idx, 3, capacity=None)
    pair_expert = top_idx.reshape(-1)[rows]
    assert torch.equal(pair_expert, pair_expert.sort(stable=True).values)
    assert torch.equal(selected, torch.tensor([5, 3, 2])) and torch.equal(kept, selected)
    rows_c, selected_c, kept_c = dispatch_order(top_idx, 3, capacity=2)
    assert torch.equal(kept_c, torch.tensor([2, 2, 2]))
    # expert 0 keeps its first two tokens in token order (tokens 0 and 1), expert 1 tokens 0 and 2
    tokens = (rows_c // 2).tolist()
    assert tokens == [0, 1, 0, 2, 1, 4]
    assert torch.equal(selected_c, selected)


def test_capacity_formula():
    c = _config(capacity_factor=1.25, top_k=2, num_experts=5)
    assert c.capacity(13) == math.ceil(13 / 5 * 1.25 * 2)
    assert _config().capacity(13) is None


def test_balance_loss_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gen = torch.Generator().manual_seed(3)
    x, wg = torch.randn(17, 6, generator=gen), torch.randn(6, 5, generator=gen)
    cfg = _config(aux_loss_coef=1.0)
    expected = load_balancing_loss_func((x @ wg,), 5, 2)
    assert torch.allclose(balance_loss(route(x, wg, cfg), cfg), expected, rtol=1e-6)


def test_grad_gate_gemm_matches_autograd_float64():
    gen = torch.Generator().manual_seed(4)
    for kw in (dict(), dict(renormalize=False), dict(aux_loss_coef=0.3, z_loss_coef=0.2)):
        cfg = _config(**kw)
        x = torch.randn(9, 6, generator=gen, dtype=torch.float64, requires_grad=True)
        wg = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
        grad_w = torch.randn(9, 2, generator=gen, dtype=torch.float64)
        r = route(x.detach(), wg.detach(), cfg)
        # autograd through the same selection: w = gather(softmax(x wg), top_idx) (/ sum)
        probs = torch.softmax(x @ wg, -1)
        top = probs.gather(1, r.top_idx)
        w = top / top.sum(-1, keepdim=True) if cfg.renormalize else top
        loss = (w * grad_w).sum()
        if cfg.aux_loss_coef:
            frac = torch.bincount(r.top_idx.reshape(-1), minlength=5).double() / 9
            loss = loss + cfg.aux_loss_coef * 5 * (frac * probs.mean(0)).sum()
        if cfg.z_loss_coef:
            loss = loss + cfg.z_loss_coef * torch.logsumexp(x @ wg, -1).square().mean()
        gx, gwg = torch.autograd.grad(loss, (x, wg))
        dx, dwg, _ = grad_gate_gemm(x.detach(), wg.detach(), r, grad_w, torch.tensor(1.0, dtype=torch.float64), cfg)
        assert torch.allclose(dx, gx, rtol=1e-12, atol=1e-14), kw
        assert torch.allclose(dwg, gwg, rtol=1e-12, atol=1e-14), kw


def test_router_gemms_in_either_layout_are_the_plain_products():
    # gate_logits / gate_weight_grad take other layouts for a narrow router on CPU (E <= NARROW_ROUTER):
    # the same products to float32 round-off, at and past the switch, and the weight gradient contiguous
    from shardmoe.moe.routing import NARROW_ROUTER, gate_logits, gate_weight_grad, narrow_router

    probe = torch.zeros(1, 1)
    assert narrow_router(probe, NARROW_ROUTER) and not narrow_router(probe, NARROW_ROUTER + 1)
    assert not narrow_router(torch.zeros(1, 1, device="meta"), 1)  # CPU only
    gen = torch.Generator().manual_seed(0)
    for num_experts in (1, NARROW_ROUTER, NARROW_ROUTER + 1, 64):
        x = torch.randn(300, 96, generator=gen, dtype=torch.float64)
        weight = torch.randn(96, num_experts, generator=gen, dtype=torch.float64)
        grad = torch.randn(300, num_experts, generator=gen, dtype=torch.float64)
        logits = gate_logits(x.float(), weight.float())
        grad_weight = gate_weight_grad(x.float(), grad.float())
        assert logits.shape == (300, num_experts) and grad_weight.shape == (96, num_experts)
        assert grad_weight.is_contiguous()
        torch.testing.assert_close(logits.double(), x @ weight, rtol=0, atol=1e-4)
        torch.testing.assert_close(grad_weight.double(), x.t() @ grad, rtol=0, atol=2e-4)
