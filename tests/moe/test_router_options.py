"""Router options of the MoE layer (score function, router and correction biases, group-limited
selection, epsilon, scaling, sequence-wise loss): exact in float64 against the independent
autograd reference, alone and combined; ties; transformers' DeepSeek-V3 and GPT-OSS routers;
errors; the correction-bias update."""
import pytest
import torch

import shardmoe
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.reference import reference_forward_backward, reference_routing
from shardmoe.moe.routing import route

H, F, E, K = 8, 6, 8, 3

DEEPSEEK = dict(score_func="sigmoid", correction_bias=True, n_group=4, topk_group=2, renormalize_epsilon=1e-20,
                routed_scaling_factor=2.5, seq_aux_loss_coef=0.3)
OPTIONS = {
    "sigmoid": dict(score_func="sigmoid"),
    "router_bias": dict(router_bias=True),
    "correction_bias": dict(correction_bias=True),
    "groups": dict(n_group=4, topk_group=2),
    "one_expert_groups": dict(n_group=8, topk_group=3),
    "scaling": dict(routed_scaling_factor=2.5),
    "epsilon": dict(renormalize_epsilon=1e-3),
    "seq_aux": dict(seq_aux_loss_coef=0.3),
    "sigmoid_losses": dict(score_func="sigmoid", aux_loss_coef=0.2, z_loss_coef=0.1),
    "sigmoid_raw_scaled": dict(score_func="sigmoid", renormalize=False, routed_scaling_factor=1.5,
                               seq_aux_loss_coef=0.2),
    "deepseek": dict(DEEPSEEK, aux_loss_coef=0.2, z_loss_coef=0.1),
    "deepseek_capacity": dict(DEEPSEEK, router_bias=True, capacity_factor=1.0),
    "gpt_oss": dict(router_bias=True, aux_loss_coef=0.2),
    "softmax_everything": dict(router_bias=True, correction_bias=True, n_group=2, topk_group=1,
                               routed_scaling_factor=0.5, seq_aux_loss_coef=0.1, aux_loss_coef=0.1,
                               z_loss_coef=0.1, capacity_factor=0.75),
}


def _layer(seed=0, dtype=torch.float64, **options):
    torch.manual_seed(seed)
    layer = shardmoe.MoE(H, F, E, K, dtype=dtype, **options)
    with torch.no_grad():
        if layer.gate_bias is not None:
            layer.gate_bias.normal_()
        if layer.correction_bias is not None:
            layer.correction_bias.normal_(0, 0.2)
    return layer


def _rel(a, b, floor=1e-3):
    return ((a - b).abs().max() / b.abs().max().clamp(min=floor)).item()


def _layer_and_reference(layer, x, grad_out, sequence_starts=None):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = layer(x, sequence_starts)
    y.backward(grad_out)  # the balance losses' gradient rides on y's backward (aux_loss_scale 1)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    bias = None if layer.correction_bias is None else layer.correction_bias.to(x.dtype)
    ref = reference_forward_backward(x.detach(), params, layer.config, grad_out, bias, sequence_starts)
    return (y, layer.aux_loss, {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}), ref


@pytest.mark.parametrize("name", list(OPTIONS))
def test_router_options_alone_and_combined_are_exact_in_float64(name):
    """Output, the weighted aux + z + sequence-wise loss and every gradient (x, gate_weight,
    gate_bias, experts) within 1e-10 relative of the plain-autograd reference, x [2, 7, H] (two
    sequences of 7)."""
    layer = _layer(**OPTIONS[name])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, H, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(2, 7, H, generator=gen, dtype=torch.float64)
    (y, aux, grads), (ref_y, ref_aux, ref_grads) = _layer_and_reference(layer, x, grad_out)
    assert _rel(y, ref_y) <= 1e-10
    assert abs(aux.item() - ref_aux.item()) <= 1e-10 * max(abs(ref_aux.item()), 1e-300)
    if layer.config.seq_aux_loss_coef or layer.config.aux_loss_coef:
        assert ref_aux.item() > 0.01  # the losses are on and reach the gradients below
    assert set(grads) == set(ref_grads)
    for n in grads:
        assert _rel(grads[n], ref_grads[n]) <= 1e-10, n
    if layer.gate_bias is not None:
        assert grads["gate_bias"].abs().max() > 1e-3


def test_sequence_starts_pick_the_sequences_of_the_sequence_wise_loss():
    """x [2, 7, H] defaults to two sequences of 7; explicit starts [0, 7] give the same loss and
    gradients bitwise, starts [0, 3, 9] another loss, exact against the reference."""
    layer = _layer(**OPTIONS["deepseek"])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, H, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(2, 7, H, generator=gen, dtype=torch.float64)
    default, _ = _layer_and_reference(layer, x, grad_out)
    explicit, _ = _layer_and_reference(layer, x, grad_out, torch.tensor([0, 7]))
    assert torch.equal(default[1], explicit[1]) and torch.equal(default[2]["gate_weight"], explicit[2]["gate_weight"])
    packed, (_, ref_aux, ref_grads) = _layer_and_reference(layer, x, grad_out, torch.tensor([0, 3, 9]))
    assert abs(packed[1].item() - default[1].item()) > 1e-6
    assert abs(packed[1].item() - ref_aux.item()) <= 1e-10 * ref_aux.item()
    assert _rel(packed[2]["gate_weight"], ref_grads["gate_weight"]) <= 1e-10


@pytest.mark.parametrize("starts, match", [
    (torch.tensor([1, 5]), r"sequence_starts: expected strictly increasing token offsets from 0 below 14"),
    (torch.tensor([0, 5, 5]), r"strictly increasing"),
    (torch.tensor([0, 14]), r"below 14"),
    (torch.tensor([0.0, 5.0]), r"sequence_starts: expected a 1-D int tensor"),
    ([0, 5], r"sequence_starts: expected a 1-D int tensor"),
])
def test_bad_sequence_starts_raise_before_work(starts, match):
    layer = _layer(seq_aux_loss_coef=0.1)
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(14, H, dtype=torch.float64), starts)
    assert layer.stats == {}
    with pytest.raises(ValueError, match=r"sequence_starts: expected None with seq_aux_loss_coef=0"):
        _layer()(torch.randn(14, H, dtype=torch.float64), torch.tensor([0]))


def test_ties_in_selection_go_to_the_lowest_index_in_layer_and_reference():
    """Experts 1 and 2 have identical gate columns (tied scores on every token), and so do the
    groups {0, 1} and {6, 7} with n_group=4: the lower expert and the lower group win, in the layer
    path and the reference alike, and the outputs and gradients stay exact."""
    for options in (dict(), dict(score_func="sigmoid", n_group=4, topk_group=1)):
        config = MoEConfig(H, F, E, 2, **options)
        gen = torch.Generator().manual_seed(3)
        # small integers and eighths: every logit is exact, so twin columns tie bitwise
        gate = torch.randint(-4, 5, (H, E), generator=gen).double() / 8
        gate[:, 2] = gate[:, 1]
        gate[:, 6], gate[:, 7] = gate[:, 0], gate[:, 1]
        x = torch.randint(-3, 4, (40, H), generator=gen).double()
        got, ref = route(x, gate, config), reference_routing(x, gate, config)
        assert torch.equal(got.top_idx, ref.selected)
        chosen = got.top_idx
        if not options:  # a twin is chosen only beside its lower twin
            for lower, higher in ((1, 2), (0, 6), (1, 7)):
                assert ((chosen == lower).any(-1) | ~(chosen == higher).any(-1)).all()
            assert (chosen == 2).any()  # the rule was exercised
        else:  # group {6, 7} ties group {0, 1}, and only one group is kept
            assert not ((chosen == 6) | (chosen == 7)).any() and ((chosen == 0) | (chosen == 1)).any()
    layer = _layer(n_group=4, topk_group=2, score_func="sigmoid")
    with torch.no_grad():
        layer.gate_weight.copy_(torch.randint(-4, 5, (H, E)).double() / 8)
        layer.gate_weight[:, 6:8] = layer.gate_weight[:, 0:2]
    x = torch.randint(-3, 4, (20, H)).double()
    (y, aux, grads), (ref_y, _, ref_grads) = _layer_and_reference(layer, x, torch.randn(20, H, dtype=torch.float64))
    assert _rel(y, ref_y) <= 1e-10 and _rel(grads["gate_weight"], ref_grads["gate_weight"]) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width,k", [(8, 2), (64, 8), (256, 8), (5, 5)])
def test_top_indices_is_the_stable_descending_sort_with_ties_and_masks(width, k, dtype):
    """float32: one topk over value-then-index keys; float64: topk where no tie can matter, the
    stable sort elsewhere. The same indices in every row, with ties planted inside the top k, at its
    edge and below it, -inf masks, -0.0 against 0.0, negative values and NaN."""
    from shardmoe.moe.routing import top_indices
    gen = torch.Generator().manual_seed(width)
    values = torch.randn(400, width, generator=gen, dtype=dtype)
    coarse = (values[:100] * 2).round() / 2  # many equal values
    values[:100] = coarse
    values[100:150, width // 2:] = float("-inf")
    values[150, :2] = torch.tensor([0.0, -0.0])
    values[151, 0] = float("nan")
    values[152, :3] = torch.tensor([-0.0, 0.0, float("nan")])
    values[153] = -1.0 - torch.arange(width) % 3  # negative values only, many equal
    want = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    assert torch.equal(top_indices(values, k), want)


def test_gpt_oss_order_top_k_of_logits_then_softmax_is_softmax_then_renormalise():
    """GPT-OSS takes the top-k of the logits and a softmax over those k; the layer's softmax over
    all E then renormalisation over the k (epsilon 0) gives the same weights to round-off."""
    gen = torch.Generator().manual_seed(4)
    x, gate = torch.randn(50, H, generator=gen, dtype=torch.float64), torch.randn(H, E, generator=gen, dtype=torch.float64)
    routing = route(x, gate, MoEConfig(H, F, E, K))
    values, indices = torch.topk(x @ gate, K, dim=-1)
    assert torch.equal(routing.top_idx, indices)
    assert (routing.weight - torch.softmax(values, -1)).abs().max() <= 1e-15


def _dense(weight, index):
    return torch.zeros(weight.shape[0], E, dtype=torch.float64).scatter_(1, index, weight.double())


def test_matches_transformers_deepseek_v3_router():
    """DeepseekV3TopkRouter (sigmoid, correction bias, 4 groups choose 2, +1e-20, factor 2.5) built
    tiny: same experts and weights (its logits are float32: ~1e-6)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
                                 norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(hf_config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        router.e_score_correction_bias.copy_(0.2 * torch.randn(E, generator=gen))
    x = torch.randn(64, H, generator=gen)
    _, hf_weight, hf_index = router(x)
    config = MoEConfig(H, F, E, K, score_func="sigmoid", correction_bias=True, n_group=4, topk_group=2,
                       renormalize_epsilon=1e-20, routed_scaling_factor=2.5)
    ours = route(x, router.weight.detach().t(), config, correction_bias=router.e_score_correction_bias)
    assert torch.equal(ours.top_idx.sort(-1).values, hf_index.sort(-1).values)
    assert _rel(_dense(ours.weight, ours.top_idx), _dense(hf_weight, hf_index)) <= 1e-6


def test_matches_transformers_gpt_oss_router():
    """GptOssTopKRouter (logits with a learnable bias, top-k of the logits, softmax of the k)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K))
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen))
        router.bias.copy_(torch.randn(E, generator=gen))
    x = torch.randn(64, H, generator=gen)
    _, hf_weight, hf_index = router(x)
    ours = route(x, router.weight.detach().t(), MoEConfig(H, F, E, K, router_bias=True), router.bias.detach())
    assert torch.equal(ours.top_idx, hf_index)
    assert _rel(_dense(ours.weight, ours.top_idx), _dense(hf_weight, hf_index)) <= 1e-6


@pytest.mark.parametrize("options, match", [
    (dict(score_func="tanh"), r"score_func: expected one of softmax, sigmoid, got 'tanh'"),
    (dict(n_group=3), r"n_group: expected a divisor of num_experts=8, got 3"),
    (dict(n_group=0), r"n_group: expected an int in 1\.\.8, got 0"),
    (dict(n_group=4, topk_group=5), r"topk_group: expected an int in 1\.\.4, got 5"),
    (dict(n_group=4, topk_group=1), r"topk_group: expected topk_group \* experts per group >= top_k=3, got 1 \* 2 = 2"),
    (dict(bias_update_rate=-0.001), r"bias_update_rate: expected a finite number >= 0, got -0\.001"),
    (dict(routed_scaling_factor=0.0), r"routed_scaling_factor: expected a finite number > 0, got 0\.0"),
    (dict(renormalize_epsilon=float("nan")), r"renormalize_epsilon: expected a finite number >= 0, got nan"),
    (dict(seq_aux_loss_coef=-1.0), r"seq_aux_loss_coef: expected a finite number >= 0, got -1\.0"),
    (dict(router_bias=1), r"router_bias: expected a bool, got 1"),
    (dict(topk=2), r"router_options: expected names among score_func, .*, got \['topk'\]"),
])
def test_bad_router_options_raise_value_error_naming_the_argument(options, match):
    with pytest.raises(ValueError, match=match):
        shardmoe.MoE(H, F, E, K, **options)


def test_update_correction_bias_moves_against_the_load_and_rides_in_the_state_dict():
    """b_e += rate * sign(mean load - load_e) in float32 (even for a bf16 layer); a no-op without
    the option; the buffer is in the state_dict and a second layer loads it."""
    layer = shardmoe.MoE(H, F, E, K, score_func="sigmoid", correction_bias=True, bias_update_rate=0.01,
                         dtype=torch.bfloat16)
    assert layer.correction_bias.dtype == torch.float32 and "correction_bias" in layer.state_dict()
    load = torch.tensor([10, 0, 5, 5, 3, 7, 2, 8])  # mean 5
    layer.update_correction_bias(load)
    layer.update_correction_bias(load)
    expected = torch.tensor([-0.02, 0.02, 0, 0, 0.02, -0.02, 0.02, -0.02], dtype=torch.float32)
    assert torch.allclose(layer.correction_bias, expected, rtol=0, atol=1e-9)
    other = shardmoe.MoE(H, F, E, K, score_func="sigmoid", correction_bias=True, dtype=torch.bfloat16)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.correction_bias, layer.correction_bias)
    plain = shardmoe.MoE(H, F, E, K)
    plain.update_correction_bias(load)
    assert plain.correction_bias is None and "correction_bias" not in plain.state_dict()
    with pytest.raises(ValueError, match=r"load: expected a tensor of shape \[8\] \(num_experts\), got \[7\]"):
        layer.update_correction_bias(load[:7])
    before = layer.correction_bias.clone()
    for bad, message in ((load.float().index_fill(0, torch.tensor([3]), float("nan")), "expected finite token counts"),
                         (load.float().index_fill(0, torch.tensor([3]), float("inf")), "expected finite token counts"),
                         (load - 6, "expected token counts >= 0"),
                         (load > 4, "expected an integer or real tensor of token counts, got dtype torch.bool"),
                         (load.to(torch.complex64), "expected an integer or real tensor")):
        with pytest.raises(ValueError, match=f"load: {message}"):
            layer.update_correction_bias(bad)
    assert torch.equal(layer.correction_bias, before)  # a NaN load was a silent no-op (sign(NaN) = 0)


def test_centred_update_keeps_the_biases_mean_and_moves_them_as_the_plain_one_less_its_mean():
    """centred=True (torchtitan's rule): u_e = rate * sign(mean load - load_e), minus mean_e u_e, in
    float32. With four experts below the mean and two above, the plain update drifts the mean by
    2 rate / 8 a step; the centred one keeps it at 0 and differs from the plain one by that mean."""
    kw = dict(score_func="sigmoid", correction_bias=True, bias_update_rate=0.01)
    plain, centred = shardmoe.MoE(H, F, E, K, **kw), shardmoe.MoE(H, F, E, K, **kw)
    load = torch.tensor([10, 1, 5, 5, 3, 2, 2, 12])  # mean 5: four below, two above, two at
    for _ in range(3):
        plain.update_correction_bias(load)
        centred.update_correction_bias(load, centred=True)
    assert abs(float(centred.correction_bias.mean())) < 1e-9
    assert abs(float(plain.correction_bias.mean()) - 3 * 0.01 * 2 / 8) < 1e-8
    assert torch.allclose(centred.correction_bias, plain.correction_bias - plain.correction_bias.mean(), atol=1e-8)
    with pytest.raises(ValueError, match="centred: expected a bool, got 'yes'"):
        centred.update_correction_bias(load, centred="yes")


def test_correction_bias_steers_selection_without_gradient():
    """A large bias on expert 0 puts it in every token's choice, its weight still comes from the
    uncorrected score, and the bias gets no gradient (it is a buffer)."""
    layer = _layer(score_func="sigmoid", correction_bias=True)
    with torch.no_grad():
        layer.correction_bias.zero_()
        layer.correction_bias[0] = 10.0
    x = torch.randn(30, H, dtype=torch.float64)
    layer(x)
    assert layer.stats["selected_per_expert"][0] == 30
    assert not layer.correction_bias.requires_grad


def test_correction_bias_stays_float32_when_the_layer_moves_to_bf16():
    """module.to(bf16) casts every floating buffer; the correction bias must not round (its updates
    of 1e-3 vanish in bf16 near |b| ~ 1), and it stays a registered buffer."""
    layer = shardmoe.MoE(8, 6, 4, 2, score_func="sigmoid", correction_bias=True, bias_update_rate=1e-3)
    with torch.no_grad():
        layer.correction_bias.fill_(1.0)
    layer.to(torch.bfloat16)
    assert layer.gate_weight.dtype == torch.bfloat16 and layer.correction_bias.dtype == torch.float32
    assert "correction_bias" in dict(layer.named_buffers())
    layer.update_correction_bias(torch.tensor([5.0, 1.0, 1.0, 1.0]))
    assert abs(layer.correction_bias[0].item() - (1 - 1e-3)) < 1e-7  # in bf16 it would stay 1.0
    layer(torch.randn(5, 8, dtype=torch.bfloat16))  # still runs in bf16 with a float32 bias
