"""The assembled transformer in float64 against an independent plain-autograd reference.

The reference below shares no code with shardmoe.model: torch's embedding, rms_norm and
cross_entropy, RoPE as complex multiplication, segments from a Python loop, a dense masked
softmax, and the MoE oracle shardmoe.moe.reference.reference_moe.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shardmoe.model.transformer import (CHECKPOINTING, Transformer, TransformerConfig, check_layout, full_shapes,
                                        init_full_weights)
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.reference import reference_moe

CONFIG = TransformerConfig(vocab_size=24, d_model=12, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=6,
                           moe=MoEConfig(12, 10, 4, 2, aux_loss_coef=0.05, z_loss_coef=0.01), rope_theta=100.0)


def segments_and_positions(is_seq_start):
    segments = torch.zeros_like(is_seq_start, dtype=torch.long)
    positions = torch.zeros_like(segments)
    for b in range(is_seq_start.shape[0]):
        segment, position = 0, 0
        for i, start in enumerate(is_seq_start[b].tolist()):
            segment, position = (segment + 1, 0) if start else (segment, position + 1)
            segments[b, i], positions[b, i] = segment, position
    return segments, positions


def rope(x, positions, theta):
    """x[B L H D] rotated pairwise (i, i + D/2) by positions * theta^(-2i/D)."""
    D = x.shape[-1]
    angle = positions[..., None].double() * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rotated = torch.complex(x[..., : D // 2], x[..., D // 2:]) * torch.polar(torch.ones_like(angle), angle)[:, :, None]
    return torch.cat([rotated.real, rotated.imag], dim=-1)


def reference_loss(w, ids, is_seq_start, targets, c: TransformerConfig):
    B, L = ids.shape
    Q, K, D = c.n_q_heads // c.n_kv_heads, c.n_kv_heads, c.head_dim
    segments, positions = segments_and_positions(is_seq_start)
    allowed = (segments[:, :, None] == segments[:, None, :]) & torch.ones(L, L, dtype=torch.bool).tril()

    def norm(x, name):
        return F.rms_norm(x, (c.d_model,), w[name], eps=c.norm_eps)

    x = F.embedding(ids, w["embedding.weight"])
    aux = 0.0
    for i in range(c.n_layers):
        p = f"blocks.{i}."
        nx = norm(x, p + "attn_norm.weight")
        # heads h = k Q + q, as a checkpoint numbers them
        w_q = w[p + "attention.w_q"].permute(0, 2, 1, 3).reshape(c.d_model, K * Q, D)
        q = rope(torch.einsum("blm,mhd->blhd", nx, w_q), positions, c.rope_theta)
        k = rope(torch.einsum("blm,mkd->blkd", nx, w[p + "attention.w_kv"][0]), positions, c.rope_theta)
        v = torch.einsum("blm,mkd->blkd", nx, w[p + "attention.w_kv"][1])
        k, v = k.repeat_interleave(Q, dim=2), v.repeat_interleave(Q, dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / D ** 0.5
        probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        o = torch.einsum("bhij,bjhd->bihd", probs, v)
        w_o = w[p + "attention.w_o"].permute(0, 2, 1, 3).reshape(c.d_model, K * Q, D)
        x = x + torch.einsum("blhd,mhd->blm", o, w_o)
        params = {"gate_weight": w[p + "moe.gate_weight"], "gate_up_proj": w[p + "moe.gate_up_proj"],
                  "down_proj": w[p + "moe.down_proj"]}
        y, layer_aux = reference_moe(norm(x, p + "ffn_norm.weight").reshape(B * L, -1), params, c.moe)
        x = x + y.reshape(B, L, -1)
        aux = aux + layer_aux
    logits = norm(x, "final_norm.weight") @ w["unembedding.weight"].t()
    return F.cross_entropy(logits.reshape(B * L, -1), targets.reshape(-1)), aux


def random_weights(seed=3):
    """Every weight generic (norm gains off 1, larger scales) so no gradient is trivially small."""
    gen = torch.Generator().manual_seed(seed)
    return {name: (1 + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)) if name.endswith("norm.weight")
            else 0.4 * torch.randn(shape, generator=gen, dtype=torch.float64)
            for name, shape in full_shapes(CONFIG).items()}


def packed_batch():
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, CONFIG.vocab_size, (3, 10), generator=gen)
    targets = torch.randint(0, CONFIG.vocab_size, (3, 10), generator=gen)
    is_seq_start = torch.zeros(3, 10, dtype=torch.bool)
    is_seq_start[:, 0] = True
    is_seq_start[0, [3, 4]] = True  # a one-token document
    is_seq_start[2, 7] = True
    return ids, is_seq_start, targets


def test_both_backward_modes_match_the_float64_reference(rel_err):
    weights = random_weights()
    reference = {k: v.clone().requires_grad_() for k, v in weights.items()}
    ids, is_seq_start, targets = packed_batch()
    ce_ref, aux_ref = reference_loss(reference, ids, is_seq_start, targets, CONFIG)
    (ce_ref + aux_ref).backward()
    for backward in ("explicit", "autograd"):
        model = Transformer(CONFIG, backward=backward, dtype=torch.float64)
        model.load_full_state_dict(weights)
        # every MoE layer draws its row buffers from one pool (exactness below covers the sharing)
        assert len({id(block.moe.workspace) for block in model.blocks}) == 1
        losses = model(ids, is_seq_start, targets)
        losses.total.backward()
        assert rel_err(losses.ce, ce_ref) <= 1e-12, backward
        assert rel_err(losses.aux, aux_ref) <= 1e-12, backward
        for name, p in model.named_parameters():
            assert rel_err(p.grad, reference[name].grad) <= 1e-10, (backward, name)


def test_logits_are_the_unembedding_of_the_trunk(rel_err):
    model = Transformer(CONFIG, dtype=torch.float64)
    model.load_full_state_dict(random_weights(5))
    ids, is_seq_start, targets = packed_batch()
    logits = model.logits(ids, is_seq_start)
    assert logits.shape == (3, 10, CONFIG.vocab_size)
    expected = F.cross_entropy(logits.reshape(30, -1), targets.reshape(-1))
    assert rel_err(model(ids, is_seq_start, targets).ce.detach(), expected) <= 1e-12


def test_initialisation_is_seeded_and_scaled():
    a, b = Transformer(CONFIG, seed=7), Transformer(CONFIG, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    full = init_full_weights(CONFIG, seed=7)
    assert torch.equal(full["blocks.1.moe.down_proj"], a.blocks[1].moe.down_proj.detach())
    assert torch.equal(full["final_norm.weight"], torch.ones(CONFIG.d_model))
    residual_std = full["blocks.0.attention.w_o"].std().item()
    assert residual_std == pytest.approx(CONFIG.init_std / 2, rel=0.2)  # 1 / sqrt(2 n_layers) = 1/2
    assert not torch.equal(Transformer(CONFIG, seed=8).embedding.weight, a.embedding.weight)


def test_meta_device_build_then_to_empty_and_reset_parameters_equals_the_eager_model():
    """The meta-device idiom: built on 'meta', materialised with to_empty() (memory of any content:
    NaN here), reset_parameters() gives every parameter and buffer, the MoE layers' correction
    biases included, the values of the model built eagerly with the same seed."""
    config = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, score_func="sigmoid", correction_bias=True,
                                                                 router_bias=True, shared_ffn_size=6))
    eager = Transformer(config, dtype=torch.float64, seed=3)
    with torch.device("meta"):
        model = Transformer(config, dtype=torch.float64, seed=3)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))
    model.reset_parameters()
    expected, got = eager.state_dict(), model.state_dict()
    assert list(got) == list(expected) and any(name.endswith("correction_bias") for name in got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_layout_and_config_errors_name_the_option():
    with pytest.raises(ValueError, match="n_kv_heads: expected a multiple of 4"):
        check_layout(CONFIG, tp=4)
    with pytest.raises(ValueError, match="num_experts: expected a multiple of 3"):
        check_layout(CONFIG, ep=3)
    with pytest.raises(ValueError, match="vocab_size: expected a multiple of 5"):
        check_layout(TransformerConfig(vocab_size=257, n_kv_heads=5, n_q_heads=5), tp=5)
    with pytest.raises(ValueError, match="d_model"):
        check_layout(CONFIG, dp=8)
    check_layout(CONFIG, dp=2, ep=2, tp=2)
    with pytest.raises(ValueError, match="n_layers"):
        TransformerConfig(n_layers=0)
    with pytest.raises(ValueError, match="top_k"):
        TransformerConfig.from_dict({"top_k": 5, "num_experts": 4})
    with pytest.raises(ValueError, match="unknown option"):
        TransformerConfig.from_dict({"d_modle": 64})
    assert TransformerConfig.from_dict(CONFIG.to_dict()) == CONFIG
    with pytest.raises(ValueError, match="state dict: missing"):
        Transformer(CONFIG).load_full_state_dict({})


def test_the_model_holds_its_moe_layers_config_whose_width_is_d_model():
    """The MoE options live in one MoEConfig (`moe`) whose hidden_size is d_model: the flat form of
    a config file derives it; a MoEConfig of another width, another expert kind or without
    renormalization is refused naming the option and both values."""
    moe = MoEConfig(12, 10, 4, 2, aux_loss_coef=0.05, z_loss_coef=0.01)
    flat = TransformerConfig.from_dict({"d_model": 16, "num_experts": 8, "expert_bias": True})
    assert flat.moe == dataclasses.replace(TransformerConfig().moe, hidden_size=16, num_experts=8, bias=True)
    assert flat.to_dict()["expert_bias"] is True and "bias" not in flat.to_dict() and "moe" not in flat.to_dict()
    with pytest.raises(ValueError, match=r"^moe.hidden_size: expected d_model=16 \(the MoE layer maps the residual "
                                         r"stream\), got 12$"):
        dataclasses.replace(CONFIG, d_model=16)
    for name, value in (("expert", "mlp"), ("renormalize", False)):
        with pytest.raises(ValueError, match=rf"^moe.{name}: expected .*, got {value!r}$"):
            dataclasses.replace(CONFIG, moe=dataclasses.replace(moe, **{name: value}))
    with pytest.raises(ValueError, match="^moe: expected a MoEConfig, got dict$"):
        TransformerConfig(moe={"num_experts": 4})
    with pytest.raises(ValueError, match=r"^d_model: expected an int >= 1, got 0$"):  # not the MoE's hidden_size
        TransformerConfig.from_dict({"d_model": 0})


def test_the_moe_options_are_read_from_moe_and_the_config_pickles():
    """The MoE options are config.moe's (config.num_experts is no attribute), and the config pickles
    (the spawned ranks receive it pickled)."""
    import pickle

    assert CONFIG.moe.num_experts == 4 and CONFIG.moe.bias is False
    with pytest.raises(AttributeError, match="no attribute 'num_experts'"):
        CONFIG.num_experts
    assert pickle.loads(pickle.dumps(CONFIG)) == CONFIG


@pytest.mark.parametrize("value", ["false", "no", 0, 1], ids=repr)
@pytest.mark.parametrize("name", ["router_bias", "correction_bias", "expert_bias", "shared_gate"])
def test_every_switch_of_the_model_is_a_bool_named_as_the_model_names_it(name, value):
    """A config file's "expert_bias": "false" built and trained expert biases ("false" is truthy);
    the refusal names the model's option, not the MoE layer's `bias`."""
    options = {"shared_ffn_size": 8} if name == "shared_gate" else {}
    with pytest.raises(ValueError, match=rf"^{name}: expected a bool, got {value!r}$"):
        TransformerConfig.from_dict({**options, name: value})
    switches = sorted(f for f, v in TransformerConfig().to_dict().items() if isinstance(v, bool))
    assert switches == ["correction_bias", "expert_bias", "router_bias", "shared_gate"]


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_activation_checkpointing_gives_the_gradients_bit_for_bit(autocast):
    """Each option recomputes in the backward what its forward dropped ("moe": each block's MoE
    layer, "block": whole blocks) and gives the losses and every gradient of "none" bit for bit,
    under autocast too (the recomputation runs under the forward's autocast state), with the
    sequence-wise balance loss over packed documents; "block" keeps less for the backward than
    "moe", which keeps less than "none"."""
    config = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, seq_aux_loss_coef=0.02))
    ids, is_seq_start, targets = packed_batch()
    results = {}
    for option in CHECKPOINTING:
        model = Transformer(config, seed=3, activation_checkpointing=option)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = model(ids, is_seq_start, targets)
        losses.total.backward()
        results[option] = (losses.ce.detach(), losses.aux.detach(), {n: p.grad for n, p in model.named_parameters()},
                           sum(saved))
    ce, aux, grads, _ = results["none"]
    assert all(g is not None for g in grads.values())
    for option in ("moe", "block"):
        other_ce, other_aux, other_grads, _ = results[option]
        assert torch.equal(other_ce, ce) and torch.equal(other_aux, aux), option
        for name, g in grads.items():
            assert torch.equal(other_grads[name], g), (option, name)
    assert results["block"][3] < results["moe"][3] < results["none"][3]
    with pytest.raises(ValueError, match="activation_checkpointing: expected one of none, moe, block, got 'all'"):
        Transformer(CONFIG, activation_checkpointing="all")
