"""activation="clamped_swiglu" (GPT-OSS) in the MoE layer: exactness against the float64 reference
(alone, with biases, capacity and the routers), the clamp's boundary, low precision, GPT-OSS's own
experts, and the refusals."""
import pytest
import torch

import shardmoe
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.reference import reference_forward_backward

CASES = [
    dict(swiglu_limit=1.5),
    dict(swiglu_limit=2.0, swiglu_alpha=0.8, bias=True, capacity_factor=0.6, aux_loss_coef=0.1),
    dict(swiglu_limit=1.5, bias=True, router_bias=True, z_loss_coef=0.01),  # GPT-OSS's router
    dict(swiglu_limit=2.5, bias=True, score_func="sigmoid", correction_bias=True, n_group=2, topk_group=1,
         renormalize_epsilon=1e-20, routed_scaling_factor=2.5, seq_aux_loss_coef=0.1),
]


def _layer(top_k, dtype=torch.float64, std=1.0, **kw):
    torch.manual_seed(0)
    layer = shardmoe.MoE(8, 6, 4, top_k, activation="clamped_swiglu", dtype=dtype, **kw)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, std)
        if layer.correction_bias is not None:
            layer.correction_bias.normal_()
    return layer


def _check_against_reference(layer, x, grad_out, bar):
    """Output and every gradient within bar (relative to the largest reference entry) of the float64 reference."""
    x = x.detach().requires_grad_()
    out = layer(x)
    ((out * grad_out).sum() + layer.aux_loss).backward()
    params = {n: p.detach().double() for n, p in layer.named_parameters()}
    cb = layer.correction_bias
    want_out, want_aux, want = reference_forward_backward(x.detach().double(), params, layer.config,
                                                          grad_out.double(), cb)
    assert (out.double() - want_out).abs().max() <= bar * want_out.abs().max()
    assert abs(layer.aux_loss.item() - want_aux.item()) <= bar * max(abs(want_aux.item()), 1e-300)
    for name, got in [("x", x.grad), *((n, p.grad) for n, p in layer.named_parameters())]:
        # floor the scale at 1e-3: with top_k=1 and renormalisation the gate gradient is round-off
        assert (got.double() - want[name]).abs().max() <= bar * max(want[name].abs().max(), 1e-3), name


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_backward_equals_reference_float64(kw, top_k):
    """Both clamp regions are hit: h ~ N(0, 8) against limits 1.5..2.5."""
    layer = _layer(top_k, **kw)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(13, 8, generator=gen, dtype=torch.float64)
    h = x @ layer.gate_up_proj.detach()[0].t()
    limit = layer.config.swiglu_limit
    assert (h[:, :6] > limit).any() and (h[:, 6:].abs() > limit).any() and (h.abs() < limit).any()
    _check_against_reference(layer, x, torch.randn(13, 8, generator=gen, dtype=torch.float64), 1e-10)


def test_inputs_planted_exactly_at_the_limits():
    """h = x[:, 0] * gate_up_proj[e, :, 0] exactly when x[:, 0] = 1 and the other columns of gate_up_proj
    are zero; planting +-L (and L + 1, -L - 1) there puts h exactly on the clamp boundaries. The other
    columns of x still steer the routing. Layer and reference agree to 1e-10 there: the clamp passes the
    gradient at the boundary (torch.clamp's closed range)."""
    limit = 2.0
    layer = _layer(1, swiglu_limit=limit)
    values = torch.tensor([limit, -limit, limit + 1, -limit - 1, 0.5, limit], dtype=torch.float64)
    with torch.no_grad():
        layer.gate_up_proj.zero_()
        for e in range(4):
            layer.gate_up_proj[e, :, 0] = torch.cat([values.roll(e), values.roll(e + 1)])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    x[:, 0] = 1.0
    h = x @ layer.gate_up_proj.detach()[0].t()
    assert (h[:, :6] == limit).all(1).logical_not().all() and (h[:, :6] == limit).any()
    assert (h[:, 6:] == -limit).any() and (h[:, 6:] == limit).any()
    layer(x)
    assert (layer.stats["tokens_per_expert"] > 0).sum() >= 2
    _check_against_reference(layer, x, torch.randn(16, 8, generator=gen, dtype=torch.float64), 1e-10)


@pytest.mark.parametrize("dtype,bar", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_within_the_documented_bars(dtype, bar):
    """fp32 and bf16 with biases and a limit that clamps, bars of docs/moe.md. The clamp's gradient jumps
    at the limit, so an element that rounding moves across it is a different function, not an error:
    x, gate_up_proj and its bias are multiples of 1/4, 1/4 and 1/16, so h is a multiple of 1/16 exact in
    bf16, and the limit 0.53 lies 0.03 from every such value."""
    torch.manual_seed(0)
    layer = shardmoe.MoE(16, 32, 4, 2, bias=True, activation="clamped_swiglu", swiglu_limit=0.53, dtype=dtype)
    gen = torch.Generator().manual_seed(1)

    def quarters(*shape):
        return torch.randint(-1, 2, shape, generator=gen).to(dtype) / 4

    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
        layer.gate_up_proj.copy_(quarters(*layer.gate_up_proj.shape))
        layer.gate_up_proj_bias.copy_(quarters(*layer.gate_up_proj_bias.shape) / 4)
    x = quarters(20, 16)
    h = torch.einsum("sh,efh->sef", x.double(), layer.gate_up_proj.detach().double())
    assert (h > 0.53).any() and (h < -0.53).any() and (h.abs() < 0.53).any()
    _check_against_reference(layer, x, torch.randn(20, 16, generator=gen).to(dtype), bar)


def test_matches_transformers_gpt_oss_experts():
    """GptOssMLP built tiny from GptOssConfig (router with bias, top-k of logits then softmax, biased
    clamped-SwiGLU experts), float64: its gate_up_proj [E, H, 2F] interleaves gate and up columns, so
    ours is [gate rows | up rows] of its transpose; its down_proj [E, F, H] is ours transposed."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    H, F, E, K = 8, 6, 4, 2
    config = GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
                          swiglu_limit=1.5)
    block = GptOssMLP(config).double()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    ours = shardmoe.MoE(H, F, E, K, bias=True, router_bias=True, activation="clamped_swiglu",
                        swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha, dtype=torch.float64)
    hf = block.experts
    with torch.no_grad():
        ours.gate_weight.copy_(block.router.weight.t())
        ours.gate_bias.copy_(block.router.bias)
        gate_up = hf.gate_up_proj.transpose(1, 2)  # [E, 2F, H], rows gate0, up0, gate1, ...
        ours.gate_up_proj.copy_(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
        ours.gate_up_proj_bias.copy_(torch.cat([hf.gate_up_proj_bias[:, 0::2], hf.gate_up_proj_bias[:, 1::2]], 1))
        ours.down_proj.copy_(hf.down_proj.transpose(1, 2))
        ours.down_proj_bias.copy_(hf.down_proj_bias)
    x = torch.randn(2, 9, H, generator=gen, dtype=torch.float64)
    gate = x @ hf.gate_up_proj.detach()[0]
    assert (gate.abs() > config.swiglu_limit).any()  # the clamps are exercised
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = block(x_hf)[0]
    got = ours(x_ours)
    grad_out = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (want * grad_out).sum().backward()
    (got * grad_out).sum().backward()
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    assert (x_ours.grad - x_hf.grad).abs().max() <= 1e-12 * x_hf.grad.abs().max()
    grad_gate_up = hf.gate_up_proj.grad.transpose(1, 2)
    assert torch.allclose(ours.gate_up_proj.grad, torch.cat([grad_gate_up[:, 0::2], grad_gate_up[:, 1::2]], 1),
                          rtol=1e-12, atol=1e-12)
    assert torch.allclose(ours.down_proj_bias.grad, hf.down_proj_bias.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options, match", [
    (dict(expert="mlp"), r"activation: 'clamped_swiglu' expects expert='glu', got expert='mlp'"),
    (dict(swiglu_limit=0.0), r"swiglu_limit: expected a finite number > 0 \(at most .*\), got 0\.0"),
    (dict(swiglu_limit=float("inf")), r"swiglu_limit: expected a finite number > 0 \(at most .*\), got inf"),
    (dict(swiglu_alpha=-1.702), r"swiglu_alpha: expected a finite number > 0 \(at most .*\), got -1\.702"),
    (dict(swiglu_alpha=True), r"swiglu_alpha: expected a finite number > 0 \(at most .*\), got True"),
    # a float32 scalar of the kernels: 1e300 was a RuntimeError traceback in the first forward
    (dict(swiglu_limit=1e300), r"swiglu_limit: expected a finite number > 0 \(at most float32's 3\.40282e\+38\), "
                               r"got 1e\+300"),
])
def test_bad_combinations_raise_before_any_work(options, match):
    with pytest.raises(ValueError, match=match):
        shardmoe.MoE(8, 6, 4, 2, activation="clamped_swiglu", **options)
    with pytest.raises(ValueError, match=match):
        MoEConfig(8, 6, 4, 2, activation="clamped_swiglu", **options)


@pytest.mark.parametrize("options, match", [
    (dict(swiglu_limit=5.0), r"swiglu_limit: expected the default 7\.0 with activation='silu' \(only "
                             r"'clamped_swiglu' uses it\), got 5\.0"),
    (dict(swiglu_alpha=1.0, expert="mlp", activation="gelu"), r"swiglu_alpha: expected the default 1\.702 with "
                                                              r"activation='gelu' .* got 1\.0"),
])
def test_a_clamp_constant_without_the_clamp_is_refused_not_ignored(options, match):
    with pytest.raises(ValueError, match=match):
        shardmoe.MoE(8, 6, 4, 2, **options)


def test_the_kernel_path_takes_the_clamp():
    from shardmoe.kernels import kernel_path
    from shardmoe.settings import override

    with override(force_kernels=True):
        assert kernel_path(MoEConfig(8, 16, 4, 2), torch.zeros(3, 8)) is True
        assert kernel_path(MoEConfig(8, 16, 4, 2, activation="clamped_swiglu"), torch.zeros(3, 8)) is True
