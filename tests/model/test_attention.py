import pytest
import torch
import torch.nn.functional as F

from shardmoe.model import (Attention, RopeTable, attention, attention_backward, attention_forward, attention_mask,
                            packed_layout, rope_table)
from shardmoe.model.attention import KVCache, attention_bias, attention_decode, default_core

THETA = 10000.0


def make_inputs(starts, d_model, q_per_kv, n_kv, head_dim, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, length = starts.shape

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, dtype=torch.float64, generator=gen) * std).to(dtype).requires_grad_()

    nx = randn(batch, length, d_model)
    w_q = randn(d_model, q_per_kv, n_kv, head_dim, std=d_model ** -0.5)
    w_kv = randn(2, d_model, n_kv, head_dim, std=d_model ** -0.5)
    w_o = randn(d_model, q_per_kv, n_kv, head_dim, std=(q_per_kv * n_kv * head_dim) ** -0.5)
    grad_out = torch.randn(batch, length, d_model, dtype=torch.float64, generator=gen).to(dtype)
    layout = packed_layout(starts)
    rope = rope_table(layout.positions, head_dim, THETA, torch.float64 if dtype == torch.float64 else torch.float32)
    return nx, w_q, w_kv, w_o, layout.segment_ids, rope, grad_out


def reference_segment(nx, w_q, w_kv, w_o):
    """One unpacked sequence nx[L M] through textbook GQA: heads h = k*Q + q, causal SDPA."""
    d_model, q_per_kv, n_kv, head_dim = w_q.shape
    length = nx.shape[0]

    def heads(w):  # [M Q K D] -> [M (K Q) D]: kv head of query head h is h // Q
        return w.permute(0, 2, 1, 3).reshape(d_model, n_kv * q_per_kv, head_dim)

    def rotate(x):  # x[H L D], positions 0..L-1
        angle = torch.arange(length).double()[:, None] * THETA ** (-torch.arange(0, head_dim, 2).double() / head_dim)
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    q = rotate(torch.einsum("lm,mhd->hld", nx, heads(w_q)))
    k = rotate(torch.einsum("lm,mkd->kld", nx, w_kv[0]))
    v = torch.einsum("lm,mkd->kld", nx, w_kv[1])
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(q_per_kv, 0), v.repeat_interleave(q_per_kv, 0),
                                       is_causal=True)
    return torch.einsum("hld,mhd->lm", o, heads(w_o))


@pytest.mark.parametrize("q_per_kv,n_kv", [(1, 2), (3, 2), (4, 1)])
def test_forward_matches_per_segment_sdpa(packed_starts, q_per_kv, n_kv):
    nx, w_q, w_kv, w_o, segment_ids, rope, _ = make_inputs(packed_starts, 12, q_per_kv, n_kv, 6)
    out, _ = attention_forward(nx, w_q, w_kv, w_o, segment_ids, rope)
    with torch.no_grad():
        for b in range(segment_ids.shape[0]):
            for seg in segment_ids[b].unique():
                tokens = (segment_ids[b] == seg).nonzero()[:, 0]
                expected = reference_segment(nx[b, tokens], w_q, w_kv, w_o)
                torch.testing.assert_close(out[b, tokens], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q_per_kv,n_kv", [(1, 2), (3, 2), (4, 1)])
def test_explicit_backward_matches_autograd(packed_starts, rel_err, q_per_kv, n_kv):
    nx, w_q, w_kv, w_o, segment_ids, rope, grad_out = make_inputs(packed_starts, 12, q_per_kv, n_kv, 6, seed=1)
    inputs = (nx, w_q, w_kv, w_o)

    out, res = attention_forward(*inputs, segment_ids, rope)
    expected = torch.autograd.grad(out, inputs, grad_out)
    grad_nx, grads = attention_backward(res, grad_out)
    wrapped = torch.autograd.grad(attention(*inputs, segment_ids, rope, backward="explicit"), inputs, grad_out)
    for name, explicit, via_function, reference in zip(
            ("nx", "w_q", "w_kv", "w_o"), (grad_nx, *grads), wrapped, expected):
        assert rel_err(explicit, reference) <= 1e-10, name
        assert rel_err(via_function, reference) <= 1e-10, name


def test_bf16_explicit_and_autograd_agree_with_float64():
    starts = torch.zeros(2, 16, dtype=torch.bool)
    starts[:, [0, 7]] = True
    args64 = make_inputs(starts, 32, 2, 2, 8, seed=2)
    out64, res64 = attention_forward(*args64[:6])
    grad_nx64, grads64 = attention_backward(res64, args64[6])

    nx, w_q, w_kv, w_o, segment_ids, _, grad_out = make_inputs(starts, 32, 2, 2, 8, dtype=torch.bfloat16, seed=2)
    rope = rope_table(packed_layout(starts).positions, 8, THETA, torch.float32)
    for backward in ("explicit", "autograd"):
        inputs = (nx, w_q, w_kv, w_o)
        out = attention(*inputs, segment_ids, rope, backward=backward)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), out64, rtol=0.05, atol=0.05)
        got = torch.autograd.grad(out, inputs, grad_out)
        for name, g, ref in zip(("nx", "w_q", "w_kv", "w_o"), got, (grad_nx64, *grads64)):
            assert g.dtype == torch.bfloat16, name
            assert (g.double() - ref).norm() <= 0.05 * ref.norm(), (backward, name)


def test_module_specs_and_shapes():
    layer = Attention(16, n_q_heads=6, n_kv_heads=2, head_dim=4)
    assert layer.SPECS == {"w_q": "M/d Q K/t D", "w_kv": "2 M/d K/t D", "w_o": "M/d Q K/t D"}
    assert layer.w_q.shape == (16, 3, 2, 4) and layer.w_kv.shape == (2, 16, 2, 4)
    with pytest.raises(ValueError, match="n_q_heads"):
        Attention(16, n_q_heads=5, n_kv_heads=2, head_dim=4)


@pytest.mark.parametrize("q_per_kv,n_kv", [(1, 2), (3, 2), (4, 1)])
@pytest.mark.parametrize("backward", ["explicit", "autograd"])
def test_fused_core_in_float32_equals_the_float64_reference(packed_starts, rel_err, q_per_kv, n_kv, backward):
    """The fused core (torch's scaled_dot_product_attention, its fused backward) in float32 against
    the reference core's formulas in float64: output and every gradient, over packed documents
    (one of a single token, a row starting mid-document), GQA and RoPE at per-document positions."""
    args64 = make_inputs(packed_starts, 12, q_per_kv, n_kv, 6, seed=4)
    out64, res64 = attention_forward(*args64[:6], core="reference")
    grad_nx64, grads64 = attention_backward(res64, args64[6])

    nx, w_q, w_kv, w_o, segment_ids, rope, grad_out = make_inputs(packed_starts, 12, q_per_kv, n_kv, 6,
                                                                  dtype=torch.float32, seed=4)
    inputs = (nx, w_q, w_kv, w_o)
    out = attention(*inputs, segment_ids, rope, backward=backward, core="fused")
    assert rel_err(out, out64) < 2e-6
    got = torch.autograd.grad(out, inputs, grad_out)
    for name, g, ref in zip(("nx", "w_q", "w_kv", "w_o"), got, (grad_nx64, *grads64)):
        assert g.dtype == torch.float32 and rel_err(g, ref) < 2e-6, name


def test_the_fused_core_is_what_float32_runs_and_a_given_bias_is_the_segments_mask(packed_starts, rel_err):
    """default_core: fused below float64; a bias made once (attention_bias, as Transformer.context
    shares it between blocks) gives the output of the one attention_forward makes from the segments;
    the explicit backward through the kernel's graph equals autograd through the kernel."""
    assert default_core(torch.float32) == default_core(torch.bfloat16) == "fused"
    assert default_core(torch.float64) == "reference"
    nx, w_q, w_kv, w_o, segment_ids, rope, grad_out = make_inputs(packed_starts, 12, 3, 2, 6, dtype=torch.float32)
    bias = attention_bias(segment_ids, torch.float32)
    assert bias.shape == (2, 1, 11, 11) and torch.equal(bias[:, 0] == 0, attention_mask(segment_ids))
    inputs = (nx, w_q, w_kv, w_o)
    out, res = attention_forward(*inputs, segment_ids, rope, for_backward=True)
    assert res.lse is None and res.fused_o is not None
    torch.testing.assert_close(attention(*inputs, segment_ids, rope, bias=bias), out, rtol=0, atol=0)
    explicit = attention_backward(res, grad_out)
    autograd = torch.autograd.grad(attention(*inputs, segment_ids, rope, backward="autograd"), inputs, grad_out)
    for g, ref in zip((explicit[0], *explicit[1]), autograd):
        assert rel_err(g, ref) < 1e-6


def test_the_fused_residuals_keep_no_score_sized_tensor():
    """What the fused explicit forward leaves for its backward (saved-tensor hooks see the kernel's
    graph too): the bias it was given, that very tensor (the blocks of a forward share it), and
    beside it nothing larger than q [B L Q K D]; no [B K Q L L] tensor."""
    L, M, Q, K, D = 64, 8, 2, 2, 4
    starts = torch.zeros(1, L, dtype=torch.bool)
    starts[0, [0, 20]] = True
    nx, w_q, w_kv, w_o, segment_ids, rope, _ = make_inputs(starts, M, Q, K, D, dtype=torch.float32)
    bias = attention_bias(segment_ids, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        attention(nx, w_q, w_kv, w_o, segment_ids, rope, core="fused", bias=bias)
    shared = [t for t in saved if t.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()]
    assert shared and all(t.numel() == L * L for t in shared)
    assert max(t.numel() for t in saved if not any(t is s for s in shared)) == L * Q * K * D


def test_decoding_with_a_kv_cache_equals_the_forward_of_the_whole_document(rel_err):
    """attention_decode of a prompt, then of tokens one and two at a time, gives the rows the
    forward over the whole document gives (one segment, positions 0..L-1), in both cores."""
    starts = torch.zeros(1, 9, dtype=torch.bool)
    starts[0, 0] = True
    for dtype in (torch.float64, torch.float32):
        nx, w_q, w_kv, w_o, segment_ids, rope, _ = make_inputs(starts, 12, 3, 2, 6, dtype=dtype)
        with torch.no_grad():
            whole, _ = attention_forward(nx, w_q, w_kv, w_o, segment_ids, rope)
            cache, rows = KVCache(9), []
            for lo, hi in ((0, 4), (4, 5), (5, 7), (7, 9)):
                part = RopeTable(rope.cos[:, lo:hi], rope.sin[:, lo:hi])
                rows.append(attention_decode(nx[:, lo:hi], w_q, w_kv, w_o, part, cache))
        assert cache.length == 9 and rel_err(torch.cat(rows, dim=1), whole) < (1e-14 if dtype == torch.float64 else 1e-6)
    with pytest.raises(ValueError, match="KV cache: expected at most 9 tokens, got 10"):
        cache.append(*(torch.zeros(1, 1, 2, 6),) * 2)
