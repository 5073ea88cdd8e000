"""MoE module: constructor and input errors, stats, copies."""
import math

import pytest
import torch

import shardmoe


def test_constructor_errors_name_argument_expected_and_actual():
    cases = [
        (dict(top_k=0), r"top_k: expected an int in 1\.\.4, got 0"),
        (dict(top_k=5), r"top_k: expected an int in 1\.\.4, got 5"),
        (dict(expert="moe"), r"expert: expected one of glu, mlp, got 'moe'"),
        (dict(activation="tanh"), r"activation: expected one of .*, got 'tanh'"),
        (dict(capacity_factor=0.0), r"capacity_factor: expected None or a positive finite number, got 0\.0"),
        (dict(capacity_factor=math.inf), r"capacity_factor: .* got inf"),
        (dict(capacity_factor=-1), r"capacity_factor: .* got -1"),
        (dict(expert="mlp", output_activation="softmax"), r"output_activation: expected one of .* got 'softmax'"),
        (dict(aux_loss_coef=float("nan")), r"aux_loss_coef: expected a finite number >= 0, got nan"),
        (dict(dtype=torch.int32), r"dtype: expected None or one of torch\.float32, .*, got torch\.int32"),
        (dict(dtype=torch.complex64), r"dtype: expected None or one of .*, got torch\.complex64"),
    ]
    for kw, pattern in cases:
        args = dict(hidden_size=8, ffn_size=6, num_experts=4, top_k=2)
        args.update(kw)
        with pytest.raises(ValueError, match=pattern):
            shardmoe.MoE(args.pop("hidden_size"), args.pop("ffn_size"), args.pop("num_experts"),
                         args.pop("top_k"), **args)


def test_input_errors_raised_before_work():
    layer = shardmoe.MoE(8, 6, 4, 2)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 8\] \(hidden_size\), got \[3, 7\]"):
        layer(torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"x: expected dtype torch\.float32 .* got torch\.float64"):
        layer(torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x: expected device cpu .* got meta"):
        layer(torch.zeros(3, 8, device="meta"))
    assert layer.aux_loss is None and layer.stats == {}


def test_output_keeps_shape_and_dtype_and_stats_count_pairs():
    layer = shardmoe.MoE(16, 32, 4, 2, capacity_factor=0.5, dtype=torch.bfloat16)
    x = torch.randn(2, 9, 16).bfloat16()
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    s = layer.stats
    assert int(s["selected_per_expert"].sum()) == 18 * 2
    assert s["capacity"] == math.ceil(18 / 4 * 0.5 * 2)
    assert int(s["tokens_per_expert"].max()) <= s["capacity"]
    assert s["dropped_tokens"] == 36 - int(s["tokens_per_expert"].sum())


def test_empty_input_gives_empty_output_and_zero_gradients():
    layer = shardmoe.MoE(8, 6, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.1)
    x = torch.zeros(0, 8, requires_grad=True)
    y = layer(x)
    (y.sum() + layer.aux_loss).backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)
    assert all(torch.count_nonzero(p.grad) == 0 for p in layer.parameters())


@pytest.mark.parametrize("expert", ["glu", "mlp"])
def test_copies_after_a_forward_start_fresh_and_leave_aux_loss_trainable(expert):
    """deepcopy (EMA), AveragedModel, pickling and state_dict work after a forward: the non-leaf
    aux_loss kept on the module would make them fail, so a copy starts without it."""
    import copy
    import io

    from torch.optim.swa_utils import AveragedModel

    layer = shardmoe.MoE(8, 6, 4, 2, expert=expert, aux_loss_coef=0.1)
    x = torch.randn(5, 8)
    out = layer(x)
    twin = copy.deepcopy(layer)
    assert twin.aux_loss is None and twin.stats == {} and layer.stats
    averaged = AveragedModel(layer)
    averaged.update_parameters(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.aux_loss is None
    for other in (twin, averaged.module, loaded):
        assert other.state_dict().keys() == layer.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), layer.state_dict().values()))
        assert torch.equal(other(x), out.detach())
    assert torch.equal(averaged(x), out.detach())
    out.sum().backward()  # the aux loss's gradient rides on out's backward
    assert not layer.aux_loss.requires_grad and layer.gate_weight.grad.abs().sum() > 0


@pytest.mark.parametrize("factor", [1e308, 2.0])
def test_capacity_factor_keeping_every_pair_caps_capacity_at_the_token_count(factor):
    """A factor >= E / k keeps every pair, so 1e308 is accepted and the capacity is S (the formula
    S / E * cf * k would overflow to inf)."""
    layer = shardmoe.MoE(8, 6, 4, 2, capacity_factor=factor, dtype=torch.float64)
    dropless = shardmoe.MoE(8, 6, 4, 2, dtype=torch.float64)
    dropless.load_state_dict(layer.state_dict())
    x = torch.randn(7, 8, dtype=torch.float64)
    assert torch.equal(layer(x), dropless(x))
    assert layer.stats["capacity"] == 7 and layer.stats["dropped_tokens"] == 0
    assert layer.config.capacity(0) == 0


@pytest.mark.parametrize("options", [
    dict(score_func="sigmoid", correction_bias=True, router_bias=True, shared_ffn_size=12, shared_gate=True),
    dict(expert="mlp", bias=True, activation="gelu"),
])
def test_meta_device_build_then_to_empty_and_reset_parameters_equals_the_eager_layer(options):
    """Built on 'meta', materialised with to_empty() (memory of any content: NaN here), the
    layer's reset_parameters() under the seed of an eager build gives every parameter and buffer
    (the correction bias too) the eager layer's value."""
    torch.manual_seed(11)
    eager = shardmoe.MoE(16, 24, 4, 2, **options)
    with torch.device("meta"):
        layer = shardmoe.MoE(16, 24, 4, 2, **options)
    layer.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*layer.parameters(), *layer.buffers()]:
            t.fill_(float("nan"))
    torch.manual_seed(11)
    layer.reset_parameters()
    expected, got = eager.state_dict(), layer.state_dict()
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
