"""The float64 reference MoE against transformers' Mixtral block and hand-derivable cases."""
import math

import pytest
import torch

from shardmoe.moe.config import MoEConfig
from shardmoe.moe.reference import (
    parameter_shapes,
    reference_forward_backward,
    reference_moe,
    reference_routing,
)

H, I, E = 8, 6, 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes: intra-op threads only add overhead (and stall on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_params(config, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[-1])).to(dtype)
        for name, shape in parameter_shapes(config).items()
    }


def random_x(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def dense_expert_outputs(x, params, config):
    """[S, E, H]: every expert on every token, written with einsum (no per-expert loop)."""
    act = {
        "relu": torch.relu,
        "gelu": lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2))),
        "gelu_tanh": lambda z: 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))),
        "silu": lambda z: z / (1 + torch.exp(-z)),
        "identity": lambda z: z,
    }
    if config.expert == "glu":
        h = torch.einsum("sh,efh->sef", x, params["gate_up_proj"])
        a = act[config.activation](h[..., :I]) * h[..., I:]
        return torch.einsum("sef,ehf->seh", a, params["down_proj"])
    z1 = torch.einsum("sh,eph->sep", x, params["w1"]) + (params["b1"] if config.bias else 0)
    z2 = torch.einsum("sep,ehp->seh", act[config.activation](z1), params["w2"]) + (params["b2"] if config.bias else 0)
    return act[config.output_activation](z2)


# --- against transformers' Mixtral block ---------------------------------------------------


@pytest.fixture(scope="module")
def modeling():
    from transformers.models.mixtral import modeling_mixtral

    return modeling_mixtral


def mixtral_block(modeling, top_k, params):
    hf_config = modeling.MixtralConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=top_k,
        hidden_act="silu", router_jitter_noise=0.0,
    )
    block = modeling.MixtralSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        block.gate.weight.copy_(params["gate_weight"].T)  # transformers stores the router as [E, H]
        block.experts.gate_up_proj.copy_(params["gate_up_proj"])
        block.experts.down_proj.copy_(params["down_proj"])
    return block


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_output_and_aux_match_mixtral(modeling, top_k, seed):
    config = MoEConfig(H, I, E, top_k, aux_loss_coef=1.0)
    params = random_params(config, seed, torch.float32)
    x = random_x((2, 5, H), seed + 100, torch.float32)

    out, aux = reference_moe(x, params, config)
    block = mixtral_block(modeling, top_k, params)
    with torch.no_grad():
        expected = block(x)
        logits = block.gate(x.reshape(-1, H))[0]
    expected_aux = modeling.load_balancing_loss_func((logits,), E, top_k)

    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, expected_aux, rtol=1e-6, atol=1e-7)


# --- hand-derivable cases --------------------------------------------------------------------


@pytest.mark.parametrize(
    "expert,activation,output_activation,bias",
    [
        ("glu", "silu", "identity", False),
        ("glu", "gelu", "identity", False),
        ("mlp", "relu", "identity", True),
        ("mlp", "gelu_tanh", "silu", True),
        ("mlp", "identity", "gelu", False),
    ],
)
def test_all_experts_renormalised_is_softmax_weighted_sum(expert, activation, output_activation, bias):
    """top_k = E with renormalisation: out_t = sum_e softmax(x_t Wg)_e * expert_e(x_t)."""
    config = MoEConfig(H, I, E, E, expert=expert, activation=activation,
                       output_activation=output_activation, bias=bias)
    params = random_params(config, 3)
    x = random_x((7, H), 4)
    out, _ = reference_moe(x, params, config)
    probs = torch.softmax(x @ params["gate_weight"], dim=-1)
    expected = torch.einsum("se,seh->sh", probs, dense_expert_outputs(x, params, config))
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-14)


def test_top1_renormalised_is_argmax_expert():
    """k = 1 with renormalisation: weight 1 on the most probable expert."""
    config = MoEConfig(H, I, E, 1)
    params = random_params(config, 5)
    x = random_x((9, H), 6)
    out, _ = reference_moe(x, params, config)
    best = (x @ params["gate_weight"]).argmax(dim=-1)
    expected = dense_expert_outputs(x, params, config)[torch.arange(9), best]
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-14)


def test_without_renormalisation_weights_are_raw_probabilities():
    config = MoEConfig(H, I, E, 2, renormalize=False)
    params = random_params(config, 7)
    x = random_x((9, H), 8)
    out, _ = reference_moe(x, params, config)
    probs = torch.softmax(x @ params["gate_weight"], dim=-1)
    top, sel = probs.topk(2, dim=-1)
    dense = dense_expert_outputs(x, params, config)
    expected = sum(top[:, i, None] * dense[torch.arange(9), sel[:, i]] for i in range(2))
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-14)


def test_capacity_keeps_first_tokens_in_token_order():
    """One expert, capacity 0.5 of 6 tokens: EC = 3, tokens 3..5 are dropped and output zero."""
    config = MoEConfig(H, I, 1, 1, capacity_factor=0.5)
    params = random_params(config, 9)
    x = random_x((6, H), 10)
    out, _ = reference_moe(x, params, config)
    expected = dense_expert_outputs(x, params, config)[:, 0]
    torch.testing.assert_close(out[:3], expected[:3], rtol=1e-13, atol=1e-14)
    assert torch.equal(out[3:], torch.zeros(3, H, dtype=torch.float64))
    routing = reference_routing(x, params["gate_weight"], config)
    assert routing.kept[:, 0].tolist() == [True] * 3 + [False] * 3
    assert routing.dropped_pairs == 3 and routing.tokens_per_expert.tolist() == [3]


def test_capacity_counts_per_expert():
    """Route tokens to chosen experts through a one-hot gate and check which pairs survive."""
    config = MoEConfig(H, I, E, 1, capacity_factor=1.0)  # S = 8: EC = ceil(8 / 4) = 2
    targets = [0, 0, 0, 1, 2, 0, 2, 2]
    x = torch.zeros(8, H, dtype=torch.float64)
    x[torch.arange(8), torch.tensor(targets)] = 1.0
    gate_weight = torch.zeros(H, E, dtype=torch.float64)
    gate_weight[:E] = 10 * torch.eye(E, dtype=torch.float64)
    routing = reference_routing(x, gate_weight, config)
    assert routing.selected[:, 0].tolist() == targets
    assert routing.kept[:, 0].tolist() == [True, True, False, True, True, False, True, False]
    assert routing.tokens_per_expert.tolist() == [2, 1, 2, 0]


def test_uniform_router_aux_losses():
    """Zero gate: p = 1/E for every token, so LB = E * sum_e (count_e/S)(1/E) = k and Z = log(E)^2."""
    k = 3
    config = MoEConfig(H, I, E, k, aux_loss_coef=0.25, z_loss_coef=0.5)
    params = random_params(config, 11)
    params["gate_weight"] = torch.zeros(H, E, dtype=torch.float64)
    _, aux = reference_moe(random_x((10, H), 12), params, config)
    assert aux.item() == pytest.approx(0.25 * k + 0.5 * math.log(E) ** 2, rel=1e-14)


def test_z_loss_is_mean_squared_logsumexp():
    config = MoEConfig(H, I, E, 2, z_loss_coef=1.0)
    params = random_params(config, 13)
    x = random_x((11, H), 14)
    _, aux = reference_moe(x, params, config)
    logits = x @ params["gate_weight"]
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 11
    assert aux.item() == pytest.approx(expected, rel=1e-13)


def test_empty_token_batch():
    config = MoEConfig(H, I, E, 2, capacity_factor=1.0, aux_loss_coef=1.0, z_loss_coef=1.0)
    params = random_params(config, 15)
    x = torch.zeros(0, H, dtype=torch.float64)
    out, aux, grads = reference_forward_backward(x, params, config, torch.zeros(0, H, dtype=torch.float64))
    assert out.shape == (0, H) and aux.item() == 0.0
    assert all(g.shape == (params | {"x": x})[n].shape and not g.any() for n, g in grads.items())


# --- the reference's own gradients -----------------------------------------------------------


@pytest.mark.parametrize("expert", ["glu", "mlp"])
def test_reference_gradients_match_finite_differences(expert):
    """Autograd through the reference agrees with central differences (float64, tiny shapes)."""
    config = MoEConfig(4, 3, 3, 2, expert=expert, activation="gelu", bias=expert == "mlp",
                       capacity_factor=1.0, aux_loss_coef=0.3, z_loss_coef=0.2)
    params = random_params(config, 16)
    names = list(params)
    x = random_x((5, 4), 17)
    grad_out = random_x((5, 4), 18)
    _, _, grads = reference_forward_backward(x, params, config, grad_out)

    def loss(*tensors):
        out, aux = reference_moe(tensors[0], dict(zip(names, tensors[1:])), config)
        return (out * grad_out).sum() + aux

    leaves = [x] + [params[n] for n in names]
    for i, name in enumerate(["x"] + names):
        for flat in range(leaves[i].numel()):
            eps = 1e-6
            bumped = [t.clone() for t in leaves]
            bumped[i].view(-1)[flat] += eps
            plus = loss(*bumped)
            bumped[i].view(-1)[flat] -= 2 * eps
            minus = loss(*bumped)
            numeric = (plus - minus).item() / (2 * eps)
            assert grads[name].view(-1)[flat].item() == pytest.approx(numeric, rel=1e-6, abs=1e-8), (name, flat)
