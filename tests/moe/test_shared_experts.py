"""Shared experts in the MoE layer (moe/shared_experts.py): exact in float64 against the independent
autograd reference, alone and with routers, capacity and biases; fp32 / bf16 within the documented
bars; transformers' Qwen2-MoE (gated shared expert) and DeepSeek-V3 (n_shared experts) blocks; errors."""
import pytest
import torch

import shardmoe
from shardmoe.kernels import kernel_path
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.reference import reference_forward_backward
from shardmoe.settings import override

H, F, E, K, FS = 8, 6, 8, 3, 10

DEEPSEEK = dict(score_func="sigmoid", correction_bias=True, n_group=4, topk_group=2, renormalize_epsilon=1e-20,
                routed_scaling_factor=2.5)
OPTIONS = {
    "shared": dict(shared_ffn_size=FS),
    "shared_gate": dict(shared_ffn_size=FS, shared_gate=True),
    "shared_gelu": dict(shared_ffn_size=4, shared_gate=True, activation="gelu"),
    "shared_mlp_experts": dict(shared_ffn_size=FS, expert="mlp", bias=True, activation="relu"),
    "deepseek": dict(DEEPSEEK, shared_ffn_size=FS, seq_aux_loss_coef=0.3),
    "qwen2_capacity_losses": dict(shared_ffn_size=FS, shared_gate=True, capacity_factor=0.75, aux_loss_coef=0.2,
                                  z_loss_coef=0.1),
    "gated_biased_glu_router_bias": dict(shared_ffn_size=FS, shared_gate=True, bias=True, router_bias=True),
}


def _layer(seed=0, dtype=torch.float64, **options):
    torch.manual_seed(seed)
    layer = shardmoe.MoE(H, F, E, K, dtype=dtype, **options)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias") or name == "shared_gate_weight":
                p.normal_(0, 0.5)  # zero-initialised: make them reach the output
        if layer.correction_bias is not None:
            layer.correction_bias.normal_(0, 0.2)
    return layer


def _rel(a, b, floor=1e-3):
    return ((a - b).abs().max() / b.abs().max().clamp(min=floor)).item()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_shared_expert_alone_and_combined_is_exact_in_float64(name):
    """Output, aux loss and every gradient (x, the router's, the routed and the shared experts',
    the shared gate's) within 1e-10 relative of the plain-autograd reference, x [2, 7, H]."""
    layer = _layer(**OPTIONS[name])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, H, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 7, H, generator=gen, dtype=torch.float64)
    y = layer(x)
    y.backward(grad_out)  # the balance losses' gradient rides on y's backward (aux_loss_scale 1)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    bias = None if layer.correction_bias is None else layer.correction_bias.double()
    ref_y, ref_aux, ref_grads = reference_forward_backward(x.detach(), params, layer.config, grad_out, bias)
    assert _rel(y, ref_y) <= 1e-10
    assert abs(layer.aux_loss.item() - ref_aux.item()) <= 1e-10 * max(abs(ref_aux.item()), 1e-300)
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    assert {"shared_gate_up_proj", "shared_down_proj"} <= set(grads) == set(ref_grads)
    for n in grads:
        assert ref_grads[n].abs().max() > 0, n  # every parameter reaches the loss
        assert _rel(grads[n], ref_grads[n]) <= 1e-10, n


def test_shared_expert_adds_exactly_its_own_output():
    """The routed part is untouched: the layer minus the same layer without its shared expert is
    s_t * shared(x_t), computed independently here."""
    layer = _layer(**OPTIONS["shared_gate"])
    plain = shardmoe.MoE(H, F, E, K, dtype=torch.float64)
    plain.load_state_dict({n: t for n, t in layer.state_dict().items() if not n.startswith("shared_")})
    x = torch.randn(5, H, dtype=torch.float64)
    wg, wu = layer.shared_gate_up_proj.detach().split(FS)
    s = torch.sigmoid(x @ layer.shared_gate_weight.detach())
    want = s[:, None] * ((torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t())) @ layer.shared_down_proj.detach().t())
    got = (layer(x) - plain(x)).detach()
    assert _rel(got, want) <= 1e-12


def test_matches_transformers_qwen2_moe_block_with_its_gated_shared_expert():
    """Qwen2MoeSparseMoeBlock built tiny (softmax top-k without renormalisation, a shared expert of
    another width scaled by sigmoid(shared_expert_gate(x))): same output, float32 routing (~1e-6)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F, shared_expert_intermediate_size=FS, num_experts=E,
                        num_experts_per_tok=K, norm_topk_prob=False)
    block = Qwen2MoeSparseMoeBlock(hf).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    layer = shardmoe.MoE(H, F, E, K, dtype=torch.float64, renormalize=False, shared_ffn_size=FS, shared_gate=True)
    mlp = block.shared_expert
    with torch.no_grad():
        layer.gate_weight.copy_(block.gate.weight.t())
        layer.gate_up_proj.copy_(block.experts.gate_up_proj)
        layer.down_proj.copy_(block.experts.down_proj)
        layer.shared_gate_up_proj.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        layer.shared_down_proj.copy_(mlp.down_proj.weight)
        layer.shared_gate_weight.copy_(block.shared_expert_gate.weight[0])
    x = torch.randn(2, 9, H, generator=gen, dtype=torch.float64)
    assert _rel(layer(x).detach(), block(x).detach()) <= 1e-6


def test_matches_transformers_deepseek_v3_moe_shared_experts():
    """DeepseekV3MoE built tiny with n_shared_experts=2: its shared MLP of width 2 * moe_intermediate_size
    is our shared_ffn_size; with the sigmoid group-limited router, correction bias and scaling."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf = DeepseekV3Config(hidden_size=H, moe_intermediate_size=F, n_shared_experts=2, n_routed_experts=E,
                          num_experts_per_tok=K, n_group=4, topk_group=2, norm_topk_prob=True,
                          routed_scaling_factor=2.5)
    block = DeepseekV3MoE(hf).double()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        block.gate.e_score_correction_bias.copy_(0.2 * torch.randn(E, generator=gen))
    layer = shardmoe.MoE(H, F, E, K, dtype=torch.float64, **DEEPSEEK, shared_ffn_size=2 * F)
    mlp = block.shared_experts
    with torch.no_grad():
        layer.gate_weight.copy_(block.gate.weight.t())
        layer.correction_bias.copy_(block.gate.e_score_correction_bias)
        layer.gate_up_proj.copy_(block.experts.gate_up_proj)
        layer.down_proj.copy_(block.experts.down_proj)
        layer.shared_gate_up_proj.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        layer.shared_down_proj.copy_(mlp.down_proj.weight)
    x = torch.randn(2, 9, H, generator=gen, dtype=torch.float64)
    assert _rel(layer(x).detach(), block(x).detach()) <= 1e-6


@pytest.mark.parametrize("options, match", [
    (dict(shared_ffn_size=-1), r"shared_ffn_size: expected an int >= 0, got -1"),
    (dict(shared_ffn_size=2.0), r"shared_ffn_size: expected an int, got float 2\.0"),
    (dict(shared_gate=True), r"shared_gate: expected False without a shared expert \(shared_ffn_size=0\), got True"),
    (dict(shared_ffn_size=4, shared_gate=1), r"shared_gate: expected a bool, got 1"),
    (dict(shared_ffn_size=4, activation="clamped_swiglu"), r"activation: expected"),
])
def test_bad_shared_options_raise_value_error_naming_the_argument(options, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(H, F, E, K, **options)


def test_kernel_path_takes_a_layer_with_a_shared_expert():
    """kernels.kernel_path: the routed experts take the Triton kernels; the shared expert, a dense
    FFN over every token, runs on torch beside them (moe/function.py)."""
    with override(force_kernels=True):
        assert kernel_path(MoEConfig(H, F, E, K), torch.zeros(3, H)) is True
        assert kernel_path(MoEConfig(H, F, E, K, shared_ffn_size=4), torch.zeros(3, H)) is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_zero_tokens_give_empty_output_and_zero_shared_gradients(dtype):
    """S = 0 (a rank without tokens): the grouped GEMMs of one empty group, zero weight gradients."""
    layer = shardmoe.MoE(16, 32, 4, 2, dtype=dtype, shared_ffn_size=16, shared_gate=True)
    x = torch.randn(0, 16, dtype=dtype, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16)
    for name in ("shared_gate_up_proj", "shared_down_proj", "shared_gate_weight"):
        grad = getattr(layer, name).grad
        assert grad is not None and grad.dtype == dtype and not grad.any(), name
