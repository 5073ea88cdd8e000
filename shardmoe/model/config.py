"""DenseConfig: the dimensions of the dense (non-MoE) parts of the transformer.

Names follow the named-axis notation used throughout shardmoe.model:
V vocab, M d_model, K kv heads, Q query heads per kv head, D head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardmoe.moe.config import is_finite_number


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


def check_positive_number(name: str, value) -> None:
    if not is_finite_number(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")


@dataclass(frozen=True)
class DenseConfig:
    """Dense dims of a Mixtral-like model; validated at construction.

    n_q_heads = Q * K query heads share K = n_kv_heads key/value heads (GQA; K = n_q_heads is
    plain multi-head attention, K = 1 multi-query). head_dim D must be even for RoPE.
    For vocab sharding over the tensor axis t, vocab_size must be a multiple of t: the byte
    tokenizer's 257 ids are usually padded up (see shardmoe.train.tokenizer.padded_vocab_size).
    """

    vocab_size: int
    d_model: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_q_heads", "n_kv_heads", "head_dim"):
            check_positive_int(name, getattr(self, name))
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(
                f"n_q_heads: expected a multiple of n_kv_heads={self.n_kv_heads}, got {self.n_q_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even int (RoPE rotates pairs), got {self.head_dim}")
        for name in ("rope_theta", "norm_eps"):
            check_positive_number(name, getattr(self, name))
