"""The tokenizer of a training run (`tokenizer` setting, `--tokenizer`): bytes, or a local Hugging Face one.

    byte                  ids 0..255 are the UTF-8 bytes of the text (the default)
    PATH (a file)         a Hugging Face `tokenizers` file, tokenizer.json (any model's, or one
                          trained locally), read with the `tokenizers` package
    PATH (a directory)    what transformers' AutoTokenizer reads from it, local files only

Nothing is downloaded. Every tokenizer maps text to ids 0..n-1 and gets one id of its own on top,
BOS = n, which opens every document and doubles as end-of-text: the last token of a document is
trained to predict the BOS of the next. So vocab_size = n + 1 (257 for bytes), and the model's
vocabulary is that, padded up (padded_vocab_size) so that it splits evenly over t; padding ids
never occur in the data and are never sampled. BOS is this extra id rather than a special token
of the tokenizer's own: a model trained here starts from nothing and needs exactly one separator,
whatever special tokens the tokenizer defines (those stay ordinary ids).

`digest` identifies the tokenizer's content (sha256 of its files), keying the token cache
(shardmoe/train/token_cache.py): the same file elsewhere hits the same cache entry, an edited one
does not.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

BYTE = "byte"
BOS = 256  # the byte tokenizer's BOS
VOCAB_SIZE = 257  # the byte tokenizer's ids: 256 bytes and BOS
VOCAB_MULTIPLE = 64  # the model's vocabulary is padded to a multiple of this: it splits over t up to 64


def padded_vocab_size(multiple: int, vocab_size: int = VOCAB_SIZE) -> int:
    """vocab_size rounded up to a multiple (e.g. 64, or the tensor-parallel size)."""
    return -(-vocab_size // multiple) * multiple


class Tokenizer:
    """ids of text and text of ids for one run: vocab_size ids, the last of them BOS.

    spec: what the `tokenizer` setting said ("byte" or the path); digest: the sha256 of its content.
    """

    def __init__(self, spec: str, digest: str, vocab_size: int, encode_batch, decode_ids):
        self.spec, self.digest, self.vocab_size = spec, digest, vocab_size
        self.bos = vocab_size - 1
        self._encode_batch, self._decode = encode_batch, decode_ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (int64, no BOS)."""
        return [np.asarray(ids, dtype=np.int64) for ids in self._encode_batch(texts)]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        """The text of ids (a sequence, array or tensor): BOS dropped; an id outside the vocabulary
        raises ValueError."""
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids: expected values in 0..{self.vocab_size - 1}, got {bad[0]}")
        return self._decode([i for i in ids if i != self.bos])

    def __repr__(self) -> str:
        return f"Tokenizer({self.spec!r}, {self.vocab_size} ids)"


def check_vocab(vocab_size: int, tokenizer: Tokenizer) -> None:
    """ValueError naming model.vocab_size unless the model has an embedding row for every id of the
    tokenizer: an id without one would make the cross-entropy meaningless (it went negative)."""
    if vocab_size < tokenizer.vocab_size:
        name = "byte tokenizer's" if tokenizer.spec == BYTE else f"tokenizer {tokenizer.spec}'s"
        raise ValueError(f"model.vocab_size: expected at least the {name} {tokenizer.vocab_size} ids (its tokens "
                         f"and BOS), got {vocab_size}")


def byte_tokenizer() -> Tokenizer:
    """Ids 0..255 are UTF-8 bytes, BOS 256; decoding turns invalid UTF-8 (possible in samples) into U+FFFD."""
    return Tokenizer(BYTE, BYTE, VOCAB_SIZE, lambda texts: [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts],
                     lambda ids: bytes(ids).decode("utf-8", errors="replace"))


def load_tokenizer(spec) -> Tokenizer:
    """The tokenizer the `tokenizer` setting names (see the module doc); ValueError naming the
    setting when it is neither "byte" nor a readable tokenizer."""
    if spec == BYTE:
        return byte_tokenizer()
    expected = f"expected {BYTE!r}, a tokenizer.json file or a directory AutoTokenizer reads"
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tokenizer: {expected}, got {spec!r}")
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"tokenizer: no such file or directory {spec!r} ({expected})")
    if path.is_dir():
        return _directory_tokenizer(spec, path)
    if not path.is_file():
        raise ValueError(f"tokenizer: {expected}, got {spec!r} (a device or other special file)")
    return _file_tokenizer(spec, path)


def _file_tokenizer(spec: str, path: Path) -> Tokenizer:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ValueError(f"tokenizer: reading {spec!r} needs the tokenizers package "
                         "(pip install 'shardmoe[hf]')") from None
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises its own exception types
        raise ValueError(f"tokenizer: cannot read {spec!r} as a Hugging Face tokenizer.json file "
                         f"({type(err).__name__}: {_first_line(err)})") from None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Tokenizer(spec, digest, hf.get_vocab_size(with_added_tokens=True) + 1,
                     lambda texts: [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)],
                     lambda ids: hf.decode(ids, skip_special_tokens=False))


def _directory_tokenizer(spec: str, path: Path) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"tokenizer: reading the directory {spec!r} needs transformers "
                         "(pip install 'shardmoe[hf]')") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # OSError, ValueError, or a backend's own type
        raise ValueError(f"tokenizer: cannot read the directory {spec!r} with transformers' AutoTokenizer "
                         f"({type(err).__name__}: {_first_line(err)})") from None
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path)}\0".encode())
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return Tokenizer(spec, digest.hexdigest(), len(hf) + 1,
                     lambda texts: hf(texts, add_special_tokens=False)["input_ids"],
                     lambda ids: hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
