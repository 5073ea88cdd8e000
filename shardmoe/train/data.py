"""Packed, resumable batches read from a token stream (the token cache's memory map).

Stream. The documents of one split, each as [BOS, ids...], concatenated in corpus order: a 1-D
array of N tokens (shardmoe/train/token_cache.py writes it once; here it is a read-only
numpy.memmap, or any 1-D integer array). BOS doubles as end-of-text: the last token of a document
is trained to predict the BOS of the next one.

Rows. The stream is cut into R = (N - 1) // L rows of L + 1 tokens with stride L: row r is
stream[r L : r L + L + 1], ids = row[:-1], targets = row[1:], so every token is an input exactly
once per epoch. is_seq_start flags BOS tokens and every row's first token (a row never sees the
text before it). The partial last row is dropped.

Order. Epoch e serves the rows in the order of a seeded permutation of 0..R-1 (shuffled_index,
keyed by (seed, e): every epoch another order), grouped into global batches of B rows; the rows
left over after the last whole batch are not served that epoch (they are other rows every epoch).
shuffle=False serves rows in stream order (evaluation). Under data parallelism, rank r of dp_size
reads rows [r B/dp, (r+1) B/dp) of each global batch, and only those: a row is computed from its
index alone, so nothing of size R (or N) is ever held in memory, whatever the corpus's size.

Position. The iterator's state is (epoch, batch index within the epoch), plus the settings that
must match on resume; state_dict()/load_state_dict() save and restore it exactly.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

FEISTEL_ROUNDS = 4
PROMPT_SCAN_TOKENS = 1 << 16  # document_prompts looks for BOS this many tokens at a time


class Batch(NamedTuple):
    ids: Tensor           # B L int64: input tokens
    targets: Tensor       # B L int64: next tokens
    is_seq_start: Tensor  # B L bool:  a segment (document or row) starts here

    def to(self, device: torch.device) -> "Batch":
        """The batch on `device`: to a GPU from pinned memory by non_blocking copies (the host goes on
        while they run), on the CPU as it is."""
        if device.type == "cpu":
            return self
        pinned = device.type == "cuda"
        return Batch(*((t.pin_memory() if pinned else t).to(device, non_blocking=pinned) for t in self))


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    batch: int  # index of the next batch within the epoch


def shuffled_index(i: int, n: int, key: str) -> int:
    """Element i of a permutation of 0..n-1 chosen by `key`, computed alone (no table of n entries).

    A balanced Feistel network over 2h bits, h = ceil(bits(n - 1) / 2), is a bijection of
    0..4^h - 1 (4^h < 4n); FEISTEL_ROUNDS rounds, each left, right = right, left ^ F(right), where
    F is blake2b keyed by (key, round) cut to h bits. Applied again to an image outside 0..n-1
    until it falls inside (cycle walking, on average under 4 times): the restriction of a
    bijection's cycles to 0..n-1 is a bijection of it."""
    if not 0 <= i < n:
        raise ValueError(f"i: expected an index in 0..{n - 1}, got {i}")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [hashlib.blake2b(f"{key}:{r}".encode(), digest_size=16).digest() for r in range(FEISTEL_ROUNDS)]
    while True:
        left, right = i >> half, i & mask
        for round_key in keys:
            f = hashlib.blake2b(right.to_bytes(8, "little"), key=round_key, digest_size=8).digest()
            left, right = right, left ^ (int.from_bytes(f, "little") & mask)
        i = (left << half) | right
        if i < n:
            return i


class PackedBatches:
    """Endless, deterministic stream of packed batches over a token stream; resumable.

    tokens: the stream [N] (see the module doc); bos: its document-start id. seq_len L and global
    batch_size B; seed fixes every epoch's row order (shuffle=False keeps stream order). dp_rank /
    dp_size select this data-parallel rank's B/dp_size rows of each global batch. num_documents,
    source (the token cache's key) and tokenizer_digest (what the ids mean) describe the stream in
    state_dict, so that a resume on other data is refused, and `shardmoe sample` can tell that the
    tokenizer at the run's path is still the one it trained with.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, *, bos: int, seed: int = 0,
                 shuffle: bool = True, dp_rank: int = 0, dp_size: int = 1, num_documents: int = 0,
                 source: str = "", tokenizer_digest: str = ""):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len, batch_size: expected ints >= 1, got {seq_len}, {batch_size}")
        if batch_size % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"batch_size={batch_size} must split evenly over dp_size={dp_size} "
                             f"and dp_rank={dp_rank} must lie in 0..{dp_size - 1}")
        if tokens.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D stream, got shape {tuple(tokens.shape)}")
        self.tokens, self.bos = tokens, bos
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_documents, self.source, self.tokenizer_digest = num_documents, source, tokenizer_digest
        self.num_tokens = int(tokens.shape[0])
        self.num_rows = max(self.num_tokens - 1, 0) // seq_len
        self.batches_per_epoch = self.num_rows // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"the documents hold {self.num_tokens} tokens, fewer than one batch of {batch_size} "
                             f"rows of {seq_len} tokens")
        self.position = DataPosition(0, 0)

    def row_index(self, epoch: int, slot: int) -> int:
        """The stream row served at `slot` (0..R-1) of epoch `epoch`."""
        if not self.shuffle:
            return slot
        return shuffled_index(slot, self.num_rows, f"rows:{self.seed}:{epoch}")

    def row(self, r: int) -> np.ndarray:
        """Stream row r: its L + 1 tokens (int64; read from the map)."""
        start = r * self.seq_len
        return np.asarray(self.tokens[start: start + self.seq_len + 1], dtype=np.int64)

    def batch_at(self, position: DataPosition) -> Batch:
        """This rank's part of the global batch at `position` (does not move the iterator)."""
        local = self.batch_size // self.dp_size
        first = position.batch * self.batch_size + self.dp_rank * local
        rows = torch.from_numpy(np.stack([self.row(self.row_index(position.epoch, s))
                                          for s in range(first, first + local)]))
        ids, targets = rows[:, :-1], rows[:, 1:]
        is_seq_start = ids == self.bos
        is_seq_start[:, 0] = True
        return Batch(ids.contiguous(), targets.contiguous(), is_seq_start)

    def epoch_batches(self, epoch: int = 0):
        """Every batch of one epoch, in order (e.g. a full validation pass); the iterator stays put."""
        for b in range(self.batches_per_epoch):
            yield self.batch_at(DataPosition(epoch, b))

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.position)
        epoch, b = self.position.epoch, self.position.batch + 1
        self.position = DataPosition(epoch + 1, 0) if b == self.batches_per_epoch else DataPosition(epoch, b)
        return batch

    def state_dict(self) -> dict:
        """The position and the settings a resume must share (plain values: checkpoint friendly)."""
        return {"epoch": self.position.epoch, "batch": self.position.batch, "seed": self.seed,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "num_documents": self.num_documents, "num_tokens": self.num_tokens, "source": self.source,
                "tokenizer_digest": self.tokenizer_digest}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; raises if the saved settings differ from this stream's.

        dp_rank and dp_size are not part of the state: a resume may change the data-parallel size
        as long as the global batch size stays the same. A state saved without `source` (the token
        cache's key) or `tokenizer_digest` is compared on the rest.
        """
        mine = self.state_dict()
        for key in ("seed", "seq_len", "batch_size", "shuffle", "tokenizer_digest", "num_documents", "num_tokens",
                    "source"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"data state: {key} was {state[key]!r} when saved, this stream has {mine[key]!r}")
        if not 0 <= state["batch"] < self.batches_per_epoch or state["epoch"] < 0:
            raise ValueError(f"data state: position (epoch {state['epoch']}, batch {state['batch']}) "
                             f"is outside an epoch of {self.batches_per_epoch} batches")
        self.position = DataPosition(state["epoch"], state["batch"])


def document_prompts(tokens: np.ndarray, bos: int, count: int, length: int) -> list[np.ndarray]:
    """The first `length` tokens (after BOS) of each of the first `count` documents of a stream
    (fewer when it holds fewer), found by scanning for BOS a block at a time from the start."""
    starts: list[int] = []
    position = 0
    while len(starts) <= count and position < tokens.shape[0]:
        block = np.asarray(tokens[position: position + PROMPT_SCAN_TOKENS])
        starts += [position + int(i) for i in np.flatnonzero(block == bos)]
        position += block.shape[0]
    ends = starts[1:] + [tokens.shape[0]]
    prompts = [np.asarray(tokens[s + 1: min(s + 1 + length, e)], dtype=np.int64)
               for s, e in zip(starts[:count], ends[:count])]
    return [p for p in prompts if p.size]
