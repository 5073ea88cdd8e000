"""The dense layers assembled into a tiny one-block model, trained by either backward."""
import torch

from shardmoe.model import Attention, DenseConfig, Embedding, RMSNorm, Unembedding, packed_layout, rope_table


class TinyDenseModel(torch.nn.Module):
    def __init__(self, config: DenseConfig, backward: str):
        super().__init__()
        kw = dict(backward=backward, dtype=torch.float64)
        self.config = config
        self.embedding = Embedding(config.vocab_size, config.d_model, **kw)
        self.norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.attention = Attention(config.d_model, config.n_q_heads, config.n_kv_heads, config.head_dim, **kw)
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.unembedding = Unembedding(config.vocab_size, config.d_model, **kw)

    def forward(self, ids, is_seq_start, targets):
        layout = packed_layout(is_seq_start)
        rope = rope_table(layout.positions, self.config.head_dim, self.config.rope_theta, torch.float64)
        x = self.embedding(ids)
        x = x + self.attention(self.norm(x), layout.segment_ids, rope)
        return self.unembedding(self.final_norm(x), targets)


def test_explicit_and_autograd_models_give_the_same_gradients(packed_starts, rel_err):
    config = DenseConfig(vocab_size=17, d_model=12, n_q_heads=4, n_kv_heads=2, head_dim=6)
    torch.manual_seed(0)
    explicit = TinyDenseModel(config, "explicit")
    for p in explicit.parameters():  # norms off 1 too, so every gradient is generic
        torch.nn.init.normal_(p, std=0.3)
    autograd = TinyDenseModel(config, "autograd")
    autograd.load_state_dict(explicit.state_dict())

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 17, packed_starts.shape, generator=gen)
    targets = torch.randint(0, 17, packed_starts.shape, generator=gen)
    loss_e = explicit(ids, packed_starts, targets)
    loss_a = autograd(ids, packed_starts, targets)
    assert rel_err(loss_e, loss_a) <= 1e-14
    loss_e.backward()
    loss_a.backward()
    for (name, p_e), p_a in zip(explicit.named_parameters(), autograd.parameters()):
        assert rel_err(p_e.grad, p_a.grad) <= 1e-10, name


def test_config_validation():
    config = DenseConfig(vocab_size=320, d_model=64, n_q_heads=8, n_kv_heads=2, head_dim=16)
    for bad in (dict(n_q_heads=6, n_kv_heads=4), dict(head_dim=7), dict(d_model=0), dict(norm_eps=-1.0)):
        kwargs = dict(vocab_size=320, d_model=64, n_q_heads=8, n_kv_heads=2, head_dim=16) | bad
        try:
            DenseConfig(**kwargs)
        except ValueError as err:
            assert next(iter(bad)) in str(err)
        else:
            raise AssertionError(f"expected a ValueError for {bad}")
