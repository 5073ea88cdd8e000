"""The notation guards the model: drop one psum / psum_scatter and the partial sum it should have
reduced raises UnreducedError at its first use, naming its spec, its axes and the consuming op.

Unreduced tracking does not depend on the mesh, so a single process (mesh=None) shows it: the
reduction is removed by replacing it, in one layer's module, with a function that returns its
input unchanged for one spec (every other call still reduces). Forward and backward run on the
assembled Transformer, so the consumer is whatever really comes next.
"""
import importlib

import pytest
import torch

from shardmoe.parallel import shardops
from shardmoe.model.transformer import Transformer, TransformerConfig
from shardmoe.moe.config import MoEConfig
from shardmoe.parallel.shardops import UnreducedError

# The modules, not the functions of the same names that shardmoe.model exports.
attention, embedding, rmsnorm, unembed = (importlib.import_module(f"shardmoe.model.{name}")
                                          for name in ("attention", "embedding", "rmsnorm", "unembed"))

CONFIG = TransformerConfig(vocab_size=16, d_model=8, n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=4,
                           moe=MoEConfig(8, 8, 2, 1, aux_loss_coef=0.01))


def _run_step(packed_starts):
    model = Transformer(CONFIG, dtype=torch.float64, seed=0)
    ids = torch.arange(22).reshape(2, 11) % CONFIG.vocab_size
    model(ids, packed_starts, (ids + 1) % CONFIG.vocab_size).total.backward()


# (module, reduction name in it, the spec whose call is dropped, what the error must say)
CASES = {
    "embedding forward": (embedding, "psum_scatter", "B/d L M -> B/d L M/t",
                          r"all_gather 'B/d L M/t -> B/d L M' got 'B/d L M' unreduced over \{t\}"),
    "attention forward": (attention, "psum_scatter", "B/d L M -> B/d L M/t",
                          r"add got an Unreduced value .*, 'B/d L M' unreduced over \{t\}"),
    "attention grad w_q, w_o": (attention, "psum_scatter", "M Q K/t D -> M/d Q K/t D",
                                r"AttentionFunction.backward returns gradient 1 as .*'M Q K/t D' unreduced over \{d\}"),
    "rmsnorm grad x": (rmsnorm, "psum_scatter", "B/d L M -> B/d L M/t",
                       r"RMSNormFunction.backward returns gradient 0 as .*'B/d L M' unreduced over \{t\}"),
    "rmsnorm grad gain": (rmsnorm, "psum_scatter", "M -> M/t/d",
                          r"RMSNormFunction.backward returns gradient 1 as .*'M' unreduced over \{d, t\}"),
    "unembedding logsumexp": (unembed, "psum", "B/d L -> B/d L",
                              r"log got an Unreduced value .*'B/d L' unreduced over \{t\}"),
    "unembedding loss": (unembed, "psum", "1 -> 1", r"'1' unreduced over \{d\}"),
    "unembedding grad w": (unembed, "psum_scatter", "V/t M -> V/t M/d",
                           r"CrossEntropyFunction.backward returns gradient 1 as .*'V/t M' unreduced over \{d\}"),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_dropped_reduction_is_named_where_its_result_is_used(monkeypatch, packed_starts, case):
    module, name, dropped, message = CASES[case]
    reduction = getattr(module, name)
    calls = []

    def without_one_reduction(spec, x, *args, **kwargs):
        if spec == dropped:
            calls.append(spec)
            return x
        return reduction(spec, x, *args, **kwargs)

    _run_step(packed_starts)  # the step runs as written
    monkeypatch.setattr(module, name, without_one_reduction)
    with pytest.raises(UnreducedError, match=message):
        _run_step(packed_starts)
    assert calls, f"{case}: the spec {dropped!r} was never reduced, so nothing was dropped"


def test_the_dropped_reductions_are_shardops():
    """The cases drop the collectives the layers really call, not copies of them."""
    for module, name, _, _ in CASES.values():
        assert getattr(module, name) is getattr(shardops, name)
