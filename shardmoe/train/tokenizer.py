"""The tokenizer of a training run (`tokenizer` setting, `--tokenizer`): bytes, or a local Hugging Face one.

    byte                  ids 0..255 are the UTF-8 bytes of the text (the default)
    PATH (a file)         a Hugging Face `tokenizers` file, tokenizer.json (any model's, or one
                          trained locally), read with the `tokenizers` package; the truncation
                          and padding it may carry (its model's serving settings) are switched
                          off, so every document is encoded whole
    PATH (a directory)    what transformers' AutoTokenizer reads from it, local files only

Nothing is downloaded. Every tokenizer maps text to ids 0..n-1 and gets one id of its own on top,
BOS = n, which opens every document and doubles as end-of-text: the last token of a document is
trained to predict the BOS of the next. So vocab_size = n + 1 (257 for bytes), and the model's
vocabulary is that, padded up (padded_vocab_size) so that it splits evenly over t; padding ids
never occur in the data and are never sampled. BOS is this extra id rather than a special token
of the tokenizer's own: a model trained here starts from nothing and needs exactly one separator,
whatever special tokens the tokenizer defines (those stay ordinary ids).

A tokenizer is read only when its ids are 0..n-1, its added tokens included (an id past n-1 would
have no embedding row, a token with the id n would be read as BOS), and when at least one of them
is not a special token (a directory holding only a model's config.json gives AutoTokenizer a
tokenizer of special tokens alone, which encodes every text to nothing). The data is checked as it
is tokenized (shardmoe/train/token_cache.py).

Long texts are encoded in pieces of about PIECE_CHARS characters, so that the tokenizer's memory
follows the piece and not the text (a 28 MB line took a tokenizer.json to 6.6 GB whole, 0.87 GB in
pieces: benchmarks/tokenize_long_line.py). A piece ends before a space that precedes a non-space,
at the first such place at or after PIECE_CHARS where the tokenizer gives the CUT_CONTEXT
characters either side, encoded together, the ids it gives the two sides encoded apart: no token
spans the cut and neither side's ids depend on the other. The pieces' ids are
then the text's wherever a token depends on the text within CUT_CONTEXT characters of it (the
pre-tokenized BPE, WordPiece and Unigram tokenizers do: their tokens never cross a word); where no
such place is found among CUT_TRIES, the rest of the text is encoded whole.

`digest` identifies the tokenizer's content (sha256 of its files), keying the token cache
(shardmoe/train/token_cache.py): the same file elsewhere hits the same cache entry, an edited one
does not. A tokenizer.json whose truncation or padding is switched off gets a digest of its own
(the file's bytes and a mark), so that a cache entry tokenized while they cut the documents is not
reused.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

BYTE = "byte"
BOS = 256  # the byte tokenizer's BOS
VOCAB_SIZE = 257  # the byte tokenizer's ids: 256 bytes and BOS
VOCAB_MULTIPLE = 64  # the model's vocabulary is padded to a multiple of this: it splits over t up to 64
PIECE_CHARS = 1 << 18  # a longer text is encoded in pieces of about this many characters (module doc)
CUT_CONTEXT = 1 << 10  # characters either side of a cut on which the tokenizer is checked
CUT_TRIES = 64  # places tried for a cut before the rest of a text is encoded whole
_CUT = re.compile(r" (?=\S)")  # a space before a non-space: where a word starts


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
        """Each text's ids (int64, no BOS); a text longer than PIECE_CHARS in pieces (module doc)."""
        out = [None] * len(texts)
        short = [i for i, text in enumerate(texts) if len(text) <= PIECE_CHARS]
        for i, ids in zip(short, self._encode_batch([texts[i] for i in short]) if short else []):
            out[i] = np.asarray(ids, dtype=np.int64)
        for i, text in enumerate(texts):
            if out[i] is None:
                out[i] = np.concatenate([np.asarray(self._encode_batch([piece])[0], dtype=np.int64)
                                         for piece in self._pieces(text)])
        return out

    def _pieces(self, text: str):
        """text in consecutive pieces, each but the last at least PIECE_CHARS long, cut where the
        tokenizer encodes the two sides apart as it does together (module doc)."""
        start = 0
        while len(text) - start > PIECE_CHARS:
            cut = self._cut(text, start + PIECE_CHARS)
            if cut is None:
                break
            yield text[start:cut]
            start = cut
        yield text[start:]

    def _cut(self, text: str, position: int) -> int | None:
        """The first of the next CUT_TRIES places at or after `position` before a space that precedes
        a non-space where the CUT_CONTEXT characters either side encode together to the ids they
        encode to apart; None when none of them does."""
        for tries, match in enumerate(_CUT.finditer(text, position)):
            if tries == CUT_TRIES:
                return None
            cut = match.start()
            left, right = text[max(0, cut - CUT_CONTEXT): cut], text[cut: cut + CUT_CONTEXT]
            together, left_ids, right_ids = self._encode_batch([left + right, left, right])
            if list(together) == [*left_ids, *right_ids]:
                return cut
        return None

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
    served = hf.truncation is not None or hf.padding is not None
    hf.no_truncation()  # a served model's max_length and batch padding would cut and pad the documents
    hf.no_padding()
    # marked when they were on: a token cache built while they cut the documents is not reused
    digest = hashlib.sha256(path.read_bytes() + (b"\0encoded whole" if served else b"")).hexdigest()
    special = {i for i, token in hf.get_added_tokens_decoder().items() if token.special}
    return Tokenizer(spec, digest, _checked_size(spec, hf.get_vocab(with_added_tokens=True), special) + 1,
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
    return Tokenizer(spec, digest.hexdigest(), _checked_size(spec, hf.get_vocab(), set(hf.all_special_ids)) + 1,
                     lambda texts: hf(texts, add_special_tokens=False)["input_ids"],
                     lambda ids: hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _checked_size(spec: str, vocab: dict[str, int], special: set[int]) -> int:
    """n, the tokenizer's number of ids, once its vocabulary (token -> id, added tokens included)
    holds the ids 0..n-1 and one that is not in `special`; ValueError naming the setting otherwise
    (see the module doc)."""
    ids = set(vocab.values())
    n = len(ids)
    if ids != set(range(n)):
        token = {i: t for t, i in vocab.items()}
        past = sorted(i for i in ids if not 0 <= i < n)
        missing = sorted(set(range(n)) - ids)
        raise ValueError(f"tokenizer: {spec!r}: expected the ids 0..{n - 1} of its {n} tokens, got id {past[0]} "
                         f"({token[past[0]]!r}){f' and {len(past) - 1} more' if len(past) > 1 else ''} past them "
                         f"and {len(missing)} missing (first {missing[0]}): an id past {n - 1} has no row in the "
                         f"model's vocabulary and the id {n} is BOS's")
    if not ids - special:
        raise ValueError(f"tokenizer: {spec!r}: expected a vocabulary, got {n} special token(s) and no other, which "
                         "encode every text to nothing (a directory needs the tokenizer's own files, e.g. "
                         "tokenizer.json, not only a model's config.json)")
    return n


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
