"""torch.compile(fullgraph=True) of shardmoe.MoE: the MoE operators (moe/ops.py) trace without a
graph break, and the compiled forward, aux loss and every gradient equal eager's (the same operator
runs in both; only the reshapes around it are compiled)."""
import pytest
import torch

import shardmoe

CONFIGS = {
    "glu": dict(),
    "mlp": dict(expert="mlp", activation="relu", output_activation="gelu", bias=True),
    "glu-capacity": dict(capacity_factor=1.0),
    "mlp-capacity": dict(expert="mlp", activation="gelu", capacity_factor=0.75),
    "shared-seq": dict(shared_ffn_size=8, shared_gate=True, seq_aux_loss_coef=0.01, router_bias=True),
}


def _layer(options):
    torch.manual_seed(0)
    return shardmoe.MoE(16, 8, 4, 2, aux_loss_coef=0.01, z_loss_coef=0.001, **options)


def _step(layer, x, grad_out, compiled=None):
    """(out, aux loss, {name: grad}) of one forward and backward, through `compiled` when given."""
    layer.zero_grad(set_to_none=True)
    layer.aux_loss_scale = 0.7  # dL/d(aux loss), riding on out's backward
    x = x.clone().requires_grad_()
    out, aux = (compiled or (lambda t: (layer(t), layer.aux_loss)))(x)
    out.backward(grad_out)
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return out.detach(), aux.detach(), grads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_layer_equals_eager_without_graph_breaks(name):
    layer = _layer(CONFIGS[name])
    x, grad_out = torch.randn(2, 12, 16), torch.randn(2, 12, 16)

    def forward(t):
        return layer(t), layer.aux_loss

    torch._dynamo.reset()
    # capacity drops make the number of kept pairs data-dependent: dynamo traces such an operator
    # only with this switch (docs/architecture.md)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops="capacity" in name):
        explained = torch._dynamo.explain(forward)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
        expected = _step(layer, x, grad_out)
        got = _step(layer, x, grad_out, compiled)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    assert got[2].keys() == expected[2].keys()
    for key, grad in expected[2].items():
        torch.testing.assert_close(got[2][key], grad, rtol=0, atol=0, msg=key)


def test_inductor_compiles_a_layer_in_a_model_and_stats_stay_current():
    torch.manual_seed(0)
    layer = _layer({})
    norm = torch.nn.LayerNorm(16)
    model = torch.nn.Sequential(norm, layer)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(3, 10, 16)
    out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    compiled(x[:, :5])  # a second shape: the stats are the operator's, of this forward
    assert int(layer.stats["tokens_per_expert"].sum()) == 3 * 5 * 2
    out.sum().backward()
    assert layer.gate_weight.grad is not None and layer.gate_up_proj.grad.abs().sum() > 0
