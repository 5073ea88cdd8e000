"""Finite-difference gradient checking on every dense layer: torch.autograd.gradcheck of its autograd.Function (the
hand-written backward) against central finite differences of its forward, in float64.

This needs no second implementation: gradcheck builds the Jacobian the backward implies (one
vector-Jacobian product per output element) and compares it column by column with
(f(v + eps e_i) - f(v - eps e_i)) / (2 eps). Steps and tolerances are the MoE layer's
(shardmoe.check.gradcheck, where their error budget is derived). Every layer is smooth, so no
input needs steering away from kinks; the sizes are the smallest that exercise each feature.
"""
import pytest
import torch
from torch.autograd import gradcheck

from shardmoe.check.gradcheck import ATOL, EPS, RTOL
from shardmoe.model import packed_layout, rope_table
from shardmoe.model.attention import AttentionFunction
from shardmoe.model.embedding import EmbeddingFunction
from shardmoe.model.rmsnorm import RMSNormFunction
from shardmoe.model.rope import RopeFunction
from shardmoe.model.unembed import CrossEntropyFunction

F64 = torch.float64


def _leaf(gen, *shape, std=1.0):
    return (torch.randn(*shape, dtype=F64, generator=gen) * std).requires_grad_()


def _check(function, *inputs):
    assert gradcheck(function, inputs, eps=EPS, atol=ATOL, rtol=RTOL)


def _packed_rows():
    """is_seq_start[2 6]: row 0 holds three documents (one of a single token), row 1 starts in the
    middle of a document (segment 0 has no start flag)."""
    starts = torch.zeros(2, 6, dtype=torch.bool)
    starts[0, [0, 3, 4]] = True
    starts[1, [2]] = True
    return packed_layout(starts)


def test_embedding_backward_is_the_jacobian_with_repeated_ids():
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([[0, 3, 3, 6], [1, 3, 2, 0]])  # 3 three times, 0 twice, 4 and 5 never
    _check(lambda weight: EmbeddingFunction.apply(ids, weight, None), _leaf(gen, 7, 3))


def test_rms_norm_backward_is_the_jacobian():
    gen = torch.Generator().manual_seed(1)
    x, gain = _leaf(gen, 2, 3, 5), _leaf(gen, 5)
    _check(lambda x, gain: RMSNormFunction.apply(x, gain, 1e-5, None), x, gain)


def test_rope_backward_is_the_jacobian_at_packed_positions():
    gen = torch.Generator().manual_seed(2)
    table = rope_table(_packed_rows().positions, 4, 100.0, F64)
    _check(lambda x: RopeFunction.apply(x, table.cos, table.sin), _leaf(gen, 2, 6, 3, 4))


@pytest.mark.parametrize("core", ["reference", "fused"])
def test_attention_backward_is_the_jacobian_with_rope_and_packed_masks(core):
    """GQA with 2 query heads per kv head, RoPE at per-document positions, the packed mask of
    _packed_rows; the Jacobian of every output wrt the input and all three weights (small dims
    keep it to ~80 columns: each costs two forwards), through either core (the fused one's
    backward is the kernel's fused backward, in float64 here)."""
    gen = torch.Generator().manual_seed(3)
    M, Q, K, D = 3, 2, 1, 4
    layout = _packed_rows()
    rope = rope_table(layout.positions, D, 100.0, F64)
    inputs = (_leaf(gen, 2, 6, M), _leaf(gen, M, Q, K, D, std=0.5), _leaf(gen, 2, M, K, D, std=0.5),
              _leaf(gen, M, Q, K, D, std=0.5))

    def function(nx, w_q, w_kv, w_o):
        return AttentionFunction.apply(nx, w_q, w_kv, w_o, layout.segment_ids, rope.cos, rope.sin, None, core, None, True)

    _check(function, *inputs)


def test_unembedding_with_cross_entropy_backward_is_the_jacobian():
    """The fused logits + cross-entropy loss (a scalar), wrt the input and the vocab table, with a
    repeated target and a denominator other than the token count."""
    gen = torch.Generator().manual_seed(4)
    targets = torch.tensor([[0, 5, 5], [2, 1, 6]])
    x, table = _leaf(gen, 2, 3, 4), _leaf(gen, 7, 4)
    _check(lambda x, table: CrossEntropyFunction.apply(x, table, targets, 5, None), x, table)
