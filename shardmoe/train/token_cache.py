"""The tokenized corpus on disk, written once and memory-mapped by every run and rank that reads it.

    CACHE/<key>/train.bin   the training documents, each [BOS, ids...], concatenated in corpus order
    CACHE/<key>/val.bin     the held-out documents, the same way
    CACHE/<key>/meta.json   dtype, token and document counts, and what the key was made of

CACHE is the `token_cache` setting, by default $SHARDMOE_CACHE_DIR/tokens (~/.cache/shardmoe/tokens,
beside the C++ passes' build): one place for every run, so a second run on the same data (another
--out, an --overwrite, a resume) reads the tokens without tokenizing again. key is a sha256 of the
data's digest (documents.data_digest: every file's format and bytes, in order), the tokenizer's
digest and vocabulary size, and the held-out split (val_fraction, SPLIT_SEED): an edited file or
another tokenizer makes another entry, a copy of the data elsewhere the same one. Tokens are
uint16 while the vocabulary fits (65,536 ids), int32 beyond.

The held-out split: round(val_fraction D) of the D documents, at least one, a choice seeded by
SPLIT_SEED whatever the run's seed (5 of the embedded corpus's 108 chapters); data of one document
holds out its last val_fraction of tokens instead, so that a text file without a blank line trains.

Building (on a cache miss): a first pass counts the documents (the split needs their number), a
second tokenizes them, in chunks, with a progress bar, appending to the two files through buffered
writes, so memory holds one chunk of documents and never the corpus. The entry is built in a
scratch directory that is renamed into place once meta.json is written, so an entry that exists is
complete; processes building the same key (the ranks of a torchrun job, each checking its setup
before any process group exists) take turns on an flock of CACHE/<key>.lock, and those after the
first find the entry built. A write that fails (a full disk) removes the scratch directory and is a
ValueError naming the cache. Each document's ids are checked as they are written
(_check_encoding): some ids for a text that is not blank, every id a token's.

Reuse is said: a process that finds its entry built prints one line naming it (when it shows
progress), so that a run that does not tokenize says why.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardmoe.train.documents import data_digest, data_files, iter_documents
from shardmoe.train.tokenizer import Tokenizer

FORMAT = "shardmoe-tokens/1"
SPLIT_SEED = 0  # the held-out documents stay the same whatever the training seed
META_FILE = "meta.json"
ENCODE_CHUNK = 256  # documents per tokenizer call


@dataclass(frozen=True)
class TokenStreams:
    """An opened cache entry: the two streams (read-only memory maps) and its metadata."""

    path: Path
    train: np.ndarray
    val: np.ndarray
    meta: dict

    @property
    def key(self) -> str:
        return self.meta["key"]


def default_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardmoe"
    return Path(os.environ.get("SHARDMOE_CACHE_DIR", base)) / "tokens"


def held_out_documents(count: int, val_fraction: float, seed: int = SPLIT_SEED) -> set[int]:
    """Indices of the round(val_fraction * count) documents (at least one) held out of `count`,
    a choice seeded by `seed`; ValueError when that leaves none to train on."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction: expected a number in (0, 1), got {val_fraction!r}")
    n_val = max(1, round(val_fraction * count))
    if n_val >= count:  # nothing left to train on
        raise ValueError(f"val_fraction: expected a fraction that leaves documents to train on, got {val_fraction!r}: "
                         f"it holds out {n_val} of the data's {count} documents")
    return set(random.Random(f"split:{seed}").sample(range(count), n_val))


def open_tokens(data, tokenizer: Tokenizer, val_fraction: float, root: str | Path | None = None, *,
                progress: bool = False) -> TokenStreams:
    """The cache entry of (data, tokenizer, split) under root (default_root() when None), built
    first if it does not exist. ValueError naming `data`, `val_fraction` or `token_cache`."""
    files = data_files(data)
    root = Path(root) if root else default_root()
    key = hashlib.sha256(json.dumps({"format": FORMAT, "data": data_digest(files), "tokenizer": tokenizer.digest,
                                     "vocab_size": tokenizer.vocab_size, "val_fraction": val_fraction,
                                     "split_seed": SPLIT_SEED}, sort_keys=True).encode()).hexdigest()[:24]
    entry = root / key
    if (entry / META_FILE).is_file():
        if progress:
            print(f"token cache: reusing {entry} ({data or 'the embedded corpus'} tokenized by {tokenizer.spec} "
                  "before)", file=sys.stderr)
        return _open(entry)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = os.open(root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ValueError(f"token_cache: cannot create the token cache in {str(root)!r} ({err.strerror})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this entry: wait for it
        if not (entry / META_FILE).is_file():
            _build(entry, key, data, files, tokenizer, val_fraction, progress)
    except OSError as err:  # the data's own read errors are ValueErrors (documents.py): a write failed
        raise ValueError(f"token_cache: cannot write the token cache in {str(root)!r} "
                         f"({err.strerror or err})") from None
    finally:
        os.close(lock)
    return _open(entry)


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def _build(entry: Path, key: str, data, files: list[Path], tokenizer: Tokenizer, val_fraction: float,
           progress: bool) -> None:
    from tqdm import tqdm

    count = sum(1 for _ in iter_documents(files))
    if count == 0:
        raise ValueError(f"data: no documents in {data!r} (every file is empty or whitespace)")
    held_out = held_out_documents(count, val_fraction) if count > 1 else set()
    dtype = _dtype(tokenizer.vocab_size)
    for stale in entry.parent.glob(f"{key}.partial-*"):  # left by a builder that died; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    scratch = entry.with_name(f"{key}.partial-{os.getpid()}")
    scratch.mkdir()
    counts = {"train_tokens": 0, "val_tokens": 0, "train_documents": 0, "val_documents": 0}
    bar = tqdm(total=count, desc=f"tokenizing ({tokenizer.spec})", unit="doc", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        with open(scratch / "train.bin", "wb", buffering=1 << 20) as train, \
                open(scratch / "val.bin", "wb", buffering=1 << 20) as val:
            def write(split: str, ids: np.ndarray) -> None:
                out = train if split == "train" else val
                out.write(np.array([tokenizer.bos], dtype=dtype).tobytes())
                out.write(ids.astype(dtype).tobytes())
                counts[f"{split}_tokens"] += ids.size + 1
                counts[f"{split}_documents"] += 1

            index = 0
            for texts in _chunks(iter_documents(files), ENCODE_CHUNK):
                for text, ids in zip(texts, tokenizer.encode_batch(texts)):
                    _check_encoding(tokenizer, ids, text, f"document {index + 1} of {data or 'the embedded corpus'}")
                    if count == 1:  # one document: its tail is held out
                        if ids.size < 2:
                            raise ValueError(f"data: {data!r} holds one document of {ids.size} token(s); expected "
                                             "at least 2 (its last val_fraction is held out)")
                        cut = ids.size - min(ids.size - 1, max(1, round(val_fraction * ids.size)))
                        write("train", ids[:cut])
                        write("val", ids[cut:])
                    else:
                        write("val" if index in held_out else "train", ids)
                    index += 1
                bar.update(len(texts))
        meta = {"format": FORMAT, "key": key, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size,
                "bos": tokenizer.bos, "documents": count, **counts, "val_fraction": val_fraction,
                "split_seed": SPLIT_SEED, "data": data, "files": len(files), "tokenizer": tokenizer.spec,
                "tokenizer_digest": tokenizer.digest}
        (scratch / META_FILE).write_text(json.dumps(meta, indent=1))
        if entry.exists():  # an entry without meta.json: an earlier layout or a hand-made directory
            shutil.rmtree(entry)
        os.replace(scratch, entry)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        bar.close()


def _check_encoding(tokenizer: Tokenizer, ids: np.ndarray, text: str, what: str) -> None:
    """ValueError naming the tokenizer and `what` (a document) unless the ids of `text` (not blank)
    are some and every one is a token's (0..n-1, below BOS): a tokenizer that drops a text, or gives
    an id without an embedding row, would lose the data silently."""
    if not ids.size:
        raise ValueError(f"tokenizer: {tokenizer.spec!r} encodes {what} ({len(text)} characters: {text[:40]!r}) to no "
                         "tokens: expected a tokenizer that encodes the data")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= tokenizer.bos:
        raise ValueError(f"tokenizer: {tokenizer.spec!r} encodes {what} to the id {low if low < 0 else high}: expected "
                         f"ids 0..{tokenizer.bos - 1} (its tokens)")


def _chunks(items, size: int):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _open(entry: Path) -> TokenStreams:
    meta = json.loads((entry / META_FILE).read_text())
    dtype = np.dtype(meta["dtype"])
    streams = {}
    for split in ("train", "val"):
        path = entry / f"{split}.bin"
        expected = meta[f"{split}_tokens"] * dtype.itemsize
        if not path.is_file() or path.stat().st_size != expected:
            raise ValueError(f"token_cache: {entry} is damaged ({path.name} should hold {expected} bytes); delete the "
                             "directory and it is rebuilt")
        streams[split] = np.memmap(path, dtype=dtype, mode="r", shape=(meta[f"{split}_tokens"],))
    return TokenStreams(entry, streams["train"], streams["val"], meta)
