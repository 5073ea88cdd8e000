"""Training data: the embedded corpus, a byte-level tokenizer, packing, a resumable iterator.

Tokenizer. Ids 0..255 are the UTF-8 bytes of the text; id 256 (BOS) opens every document.
BOS doubles as end-of-text: the last byte of a document is trained to predict the BOS of the next
one. VOCAB_SIZE = 257; pad it with padded_vocab_size() so the vocab splits evenly over 't'.

Packing. An epoch concatenates the documents, each as [BOS, bytes...], in a seeded order into one
token stream, and cuts it into rows of L + 1 tokens with stride L: ids = row[:-1], targets =
row[1:], so every stream token is an input exactly once. is_seq_start flags BOS tokens and every
row's first token (a row never sees the text before it). The trailing partial row is dropped.
Rows are then shuffled (seeded) and grouped into global batches of B rows; a batch that would be
incomplete is dropped. Under data parallelism, rank r of dp_size takes rows [r B/dp, (r+1) B/dp).

Position. The iterator's state is (epoch, batch index within the epoch), plus the settings that
must match on resume; state_dict()/load_state_dict() save and restore it exactly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources
from typing import NamedTuple

import torch
from torch import Tensor

CORPUS_FILE = "kjv_narratives.txt"
BOS = 256
VOCAB_SIZE = 257


def padded_vocab_size(multiple: int) -> int:
    """VOCAB_SIZE rounded up to a multiple (e.g. 64, or the tensor-parallel size)."""
    return -(-VOCAB_SIZE // multiple) * multiple


def encode(text: str) -> Tensor:
    """UTF-8 bytes of text as int64 ids [N] (no BOS)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids: Tensor) -> str:
    """Text of ids [N]: BOS tokens are dropped, invalid UTF-8 (e.g. from sampling) becomes U+FFFD."""
    ids = ids.reshape(-1)
    if ids.numel() and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(f"ids: expected values in 0..{VOCAB_SIZE - 1}, got {ids.min()}..{ids.max()}")
    return bytes(ids[ids != BOS].to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_corpus() -> list[str]:
    """The embedded corpus (see shardmoe/train/data/README.md) as its documents, in file order."""
    text = resources.files("shardmoe.train").joinpath("data", CORPUS_FILE).read_text(encoding="utf-8")
    return text.rstrip("\n").split("\n\n")


def split_documents(documents: list[str], val_fraction: float = 0.05,
                    seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, validation): a seeded choice of round(val_fraction N) documents, at least one, held out.

    Both keep corpus order; the split depends only on (N, val_fraction, seed).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction: expected a number in (0, 1), got {val_fraction!r}")
    n_val = max(1, round(val_fraction * len(documents)))
    if n_val >= len(documents):  # nothing left to train on: it crashed at step 1, after the run began
        raise ValueError(f"val_fraction: expected a fraction that leaves documents to train on, got {val_fraction!r}: "
                         f"it holds out {n_val} of the corpus's {len(documents)} documents")
    held_out = set(random.Random(f"split:{seed}").sample(range(len(documents)), n_val))
    train = [d for i, d in enumerate(documents) if i not in held_out]
    val = [d for i, d in enumerate(documents) if i in held_out]
    return train, val


class Batch(NamedTuple):
    ids: Tensor           # B L int64: input tokens
    targets: Tensor       # B L int64: next tokens
    is_seq_start: Tensor  # B L bool:  a segment (document or row) starts here


@dataclass(frozen=True)
class DataPosition:
    epoch: int
    batch: int  # index of the next batch within the epoch


class PackedBatches:
    """Endless, deterministic stream of packed batches over `documents`; resumable.

    seq_len L and global batch_size B; seed fixes every epoch's document order and row order
    (shuffle=False keeps both in corpus order, for evaluation). dp_rank/dp_size select this data-
    parallel rank's B/dp_size rows of each global batch.
    """

    def __init__(self, documents: list[str], seq_len: int, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, dp_rank: int = 0, dp_size: int = 1):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len, batch_size: expected ints >= 1, got {seq_len}, {batch_size}")
        if batch_size % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(f"batch_size={batch_size} must split evenly over dp_size={dp_size} "
                             f"and dp_rank={dp_rank} must lie in 0..{dp_size - 1}")
        bos = torch.tensor([BOS])
        self._documents = [torch.cat([bos, encode(d)]) for d in documents]
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # Every epoch packs the same tokens, so the row count does not depend on the order.
        self.num_tokens = sum(d.numel() for d in self._documents)
        self.batches_per_epoch = (self.num_tokens - 1) // seq_len // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"the documents hold fewer than one batch of {batch_size} rows of {seq_len} tokens")
        self.position = DataPosition(0, 0)
        self._cached_epoch: tuple[int, Tensor] | None = None

    def document_order(self, epoch: int) -> list[int]:
        """Indices of the documents in the order an epoch packs them."""
        order = list(range(len(self._documents)))
        if self.shuffle:
            random.Random(f"documents:{self.seed}:{epoch}").shuffle(order)
        return order

    def _rows(self, epoch: int) -> Tensor:
        """All rows [R L+1] of an epoch, in the order they are served."""
        stream = torch.cat([self._documents[i] for i in self.document_order(epoch)])
        n_rows = (stream.numel() - 1) // self.seq_len
        # Stride L, width L + 1: the last token of row r is the first of row r + 1.
        rows = stream[: n_rows * self.seq_len + 1].unfold(0, self.seq_len + 1, self.seq_len)
        if self.shuffle:
            row_order = list(range(n_rows))
            random.Random(f"rows:{self.seed}:{epoch}").shuffle(row_order)
            rows = rows[torch.tensor(row_order)]
        return rows

    def _epoch_rows(self, epoch: int) -> Tensor:
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            self._cached_epoch = (epoch, self._rows(epoch))
        return self._cached_epoch[1]

    def batch_at(self, position: DataPosition) -> Batch:
        """This rank's part of the global batch at `position` (does not move the iterator)."""
        local = self.batch_size // self.dp_size
        first = position.batch * self.batch_size + self.dp_rank * local
        rows = self._epoch_rows(position.epoch)[first: first + local]
        ids, targets = rows[:, :-1], rows[:, 1:]
        is_seq_start = ids == BOS
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
        """The position and the settings a resume must share (plain ints: checkpoint friendly)."""
        return {"epoch": self.position.epoch, "batch": self.position.batch, "seed": self.seed,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "num_documents": len(self._documents), "num_tokens": self.num_tokens}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; raises if the saved settings differ from this stream's.

        dp_rank and dp_size are not part of the state: a resume may change the data-parallel size
        as long as the global batch size stays the same.
        """
        mine = self.state_dict()
        for key in ("seed", "seq_len", "batch_size", "shuffle", "num_documents", "num_tokens"):
            if state[key] != mine[key]:
                raise ValueError(f"data state: {key} was {state[key]!r} when saved, this stream has {mine[key]!r}")
        if not 0 <= state["batch"] < self.batches_per_epoch or state["epoch"] < 0:
            raise ValueError(f"data state: position (epoch {state['epoch']}, batch {state['batch']}) "
                             f"is outside an epoch of {self.batches_per_epoch} batches")
        self.position = DataPosition(state["epoch"], state["batch"])
