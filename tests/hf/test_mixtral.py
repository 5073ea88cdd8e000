"""shardmoe.hf.mixtral: a MixtralForCausalLM built from a small local config (no downloads) as shardmoe's
Transformer and back."""
import pytest
import torch

from shardmoe.model.transformer import Transformer, TransformerConfig
from shardmoe.moe.config import MoEConfig

transformers = pytest.importorskip("transformers")


def mixtral():
    import shardmoe.hf.mixtral  # not at collection: see tests/hf/conftest.py

    return shardmoe.hf.mixtral


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # norm gains off 1, so a mix-up between the two norms would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def test_loaded_model_matches_mixtral_logits_and_loss(hf_model):
    model = mixtral().from_mixtral(hf_model)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf = hf_model(input_ids=ids, labels=ids)
    one_document = torch.zeros_like(ids, dtype=torch.bool)
    one_document[:, 0] = True
    logits = model.logits(ids, one_document)
    assert ((logits - hf.logits).norm() / hf.logits.norm()).item() <= 1e-5
    with torch.no_grad():  # Mixtral's labels shift by one inside; ours are given shifted
        ce = model(ids[:, :-1], one_document[:, :-1], ids[:, 1:]).ce
    assert abs(ce.item() - hf.loss.item()) <= 1e-5 * hf.loss.item()


def test_export_round_trips_the_state_dict(hf_model):
    exported = mixtral().export_mixtral(mixtral().from_mixtral(hf_model))
    original = hf_model.state_dict()
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    rebuilt = transformers.MixtralForCausalLM(hf_model.config)
    rebuilt.load_state_dict(exported, strict=True)


def test_config_round_trip_and_unsupported_options():
    config = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=8,
                               moe=MoEConfig(32, 24, 4, 2, aux_loss_coef=0.01), rope_theta=500.0)
    assert mixtral().config_from_mixtral(mixtral().mixtral_config(config)) == config
    with pytest.raises(ValueError, match="sliding_window"):
        mixtral().config_from_mixtral(mixtral().mixtral_config(config, sliding_window=16))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        mixtral().config_from_mixtral(mixtral().mixtral_config(config, tie_word_embeddings=True))


def test_exports_refuse_what_mixtral_cannot_hold():
    """A Mixtral config or state dict has nowhere to put another router (a sigmoid score, a bias,
    groups), glu biases, the clamp or a shared expert: the model's exports refuse instead of silently
    dropping them."""
    tiny = dict(vocab_size=16, d_model=8, n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=4)
    cases = [
        (dict(score_func="sigmoid"), r"expected Mixtral's router \(score_func='softmax'\), got score_func='sigmoid'"),
        (dict(router_bias=True), r"expected Mixtral's router \(router_bias=False\), got router_bias=True"),
        (dict(n_group=2, topk_group=1), r"expected Mixtral's router \(n_group=1\), got n_group=2"),
        (dict(bias=True), r"expert_bias: expected False .* got True"),
        (dict(activation="clamped_swiglu"), r"activation: expected 'silu' .* got 'clamped_swiglu'"),
        (dict(shared_ffn_size=4), r"expected no shared expert \(shared_ffn_size=0, as Mixtral\), got shared_ffn_size=4"),
    ]
    for options, match in cases:
        config = TransformerConfig(**tiny, moe=MoEConfig(8, 8, 4, 2, **options))
        with pytest.raises(ValueError, match="mixtral_config: " + match):
            mixtral().mixtral_config(config)
        with pytest.raises(ValueError, match="to_mixtral_state_dict: " + match):
            mixtral().to_mixtral_state_dict(Transformer(config).full_state_dict(), config)
        with pytest.raises(ValueError, match="to_mixtral_state_dict: " + match):
            mixtral().export_mixtral(Transformer(config))
