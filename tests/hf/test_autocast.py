"""The transformers seam under torch.autocast: the experts compute in the autocast dtype while the
model's parameters stay float32 and get float32 gradients, as transformers' grouped_mm does."""
import torch


def _step(implementation):
    import shardmoe.hf  # noqa: F401  (registers "shardmoe"; not at collection: tests/hf/conftest.py)
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        use_cache=False)
    model = MixtralForCausalLM._from_config(cfg, experts_implementation=implementation)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_seam_under_autocast_matches_grouped_mm():
    want_loss, want = _step("grouped_mm")
    loss, got = _step("shardmoe")
    assert abs(loss.item() - want_loss.item()) <= 1e-2 * abs(want_loss.item())
    for name, grad in want.items():
        assert got[name].dtype == torch.float32, name
        scale = grad.abs().max().clamp(min=1e-6)
        assert ((got[name] - grad).abs().max() / scale).item() <= 5e-2, name
