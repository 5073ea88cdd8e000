"""Sampling with a KV cache: the same tokens as recomputing every window for the same draws, with
the prompt cut to seq_len and windows restarting; each new token runs alone against the cache."""
import numpy as np
import torch

from shardmoe.model.transformer import Transformer
from shardmoe.train.sample import sample, window_start
from shardmoe.train.tokenizer import byte_tokenizer

from .conftest import TINY_MODEL


def test_the_window_holds_the_prompts_last_seq_len_and_restarts_at_the_last_half():
    assert window_start(None, 5, 8) == 0 and window_start(None, 11, 8) == 3
    assert window_start(3, 11, 8) == 3  # 8 ids: it goes on
    assert window_start(3, 12, 8) == 8  # 9 would be too many: the last 4 stay
    assert window_start(0, 2, 1) == 1 and window_start(1, 2, 1) == 1


def test_the_kv_cache_draws_the_tokens_recomputing_draws(monkeypatch, one_thread):
    """A tiny model whose weights make the logits spread (not one sure token), a prompt longer
    than seq_len, 40 tokens: the cached path and the recomputing one draw the same ids from
    generators of the same seed, across five window restarts; the cached model runs the first
    window whole, then one token per call but at a restart (its kept half window)."""
    model = Transformer(TINY_MODEL, seed=5)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(30)  # a trained model's confidence, not init's uniform logits
    tokenizer, seq_len = byte_tokenizer(), 16
    prompt = np.frombuffer(b"And it came to pass in those days", dtype=np.uint8).astype(np.int64)
    lengths, real = [], Transformer.decode

    def counting(self, ids, caches):
        lengths.append(ids.shape[1])
        return real(self, ids, caches)

    monkeypatch.setattr(Transformer, "decode", counting)
    drawn = {}
    for cache in (True, False):
        drawn[cache] = sample(model, prompt, 40, tokenizer=tokenizer, seq_len=seq_len, temperature=1.0,
                              generator=torch.Generator().manual_seed(7), cache=cache)
    assert drawn[True].tolist() == drawn[False].tolist() and len(set(drawn[True].tolist())) > 5
    restarts = [i for i, n in enumerate(lengths) if n > 1]
    assert lengths[0] == seq_len and [lengths[i] for i in restarts[1:]] == [seq_len // 2] * 5
    assert len(lengths) == 40 and all(n == 1 for i, n in enumerate(lengths) if i not in restarts)
