"""The documents a run trains on (`data` setting, `--data`): the embedded corpus, or files.

`data` is None (the embedded KJV corpus, shardmoe/train/data/README.md), a file, a directory (every
file under it, recursively, except hidden ones, whose name starts with a dot) or a glob pattern
(`corpus/*.jsonl`, `**` included); the files are read in sorted path order. A path that exists is
read as itself, so `notes[1].txt` is that file, never the glob that matches `notes1.txt`. Each
file's format follows its suffix, and so does the rule of where a document ends:

    .jsonl     one JSON object per line; the document is its "text" string (blank lines skipped)
    .parquet   one row per document, its "text" column (needs pyarrow)
    any other  UTF-8 text: documents are separated by blank lines (lines of whitespace only), a
               file without one is one document; a document's text is its lines without the
               newline of the last one

A document whose text is empty or only whitespace is skipped: it holds nothing to train on.
Files are streamed, so memory holds one document (one Parquet batch) at a time. Every error is a
ValueError that names the `data` setting and the file (and line) at fault: a file that cannot be
read, text that is not UTF-8, a JSONL string holding a lone surrogate (`"\\ud800"`: JSON escapes
it, no encoding can store it).
"""
from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

CORPUS_FILE = "kjv_narratives.txt"
FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}  # any other suffix: text
TEXT_FIELD = "text"
PARQUET_BATCH_ROWS = 1024


def embedded_corpus() -> Path:
    """The embedded corpus file (package data)."""
    return Path(str(resources.files("shardmoe.train").joinpath("data", CORPUS_FILE)))


def data_files(data) -> list[Path]:
    """The files `data` names (see the module doc), in reading order; ValueError naming `data` when
    it names nothing readable."""
    if data is None:
        return [embedded_corpus()]
    if not isinstance(data, str) or not data:
        raise ValueError(f"data: expected a file, a directory or a glob pattern (or null for the embedded corpus), "
                         f"got {data!r}")
    path = Path(data)
    if not path.exists():  # a path that exists is itself, even when its name holds [, ? or *
        if glob.has_magic(data):
            files = sorted(Path(p) for p in glob.glob(data, recursive=True) if Path(p).is_file())
            if not files:
                raise ValueError(f"data: no files match {data!r}")
            return files
        raise ValueError(f"data: no such file or directory {data!r}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise ValueError(f"data: the directory {data!r} holds no files")
        return files
    if not path.is_file():
        raise ValueError(f"data: expected a file, a directory or a glob pattern, got {data!r} (a device or "
                         "other special file)")
    return [path]


def file_format(path: Path) -> str:
    """"jsonl", "parquet" or "text" (by suffix)."""
    return FORMATS.get(path.suffix.lower(), "text")


def data_digest(files: list[Path]) -> str:
    """sha256 over each file's format and content, in order: the same data in another place has the
    same digest, an edited, added, removed or reordered file changes it. Reads every byte."""
    digest = hashlib.sha256()
    for path in files:
        content = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    content.update(block)
        except OSError as err:
            raise _unreadable(path, err) from None
        digest.update(f"{file_format(path)}\0".encode())
        digest.update(content.digest())
    return digest.hexdigest()


def iter_documents(files: list[Path]) -> Iterator[str]:
    """Every document of the files, in order (see the module doc for each format's rule)."""
    readers = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}
    for path in files:
        for text in readers[file_format(path)](path):
            if text.strip():
                yield text


def load_corpus() -> list[str]:
    """The embedded corpus's documents, in file order (108 chapters)."""
    return list(iter_documents([embedded_corpus()]))


def _text_documents(path: Path) -> Iterator[str]:
    lines: list[str] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield _joined(lines)
                    lines = []
    except UnicodeDecodeError as err:
        raise ValueError(f"data: {path} is not UTF-8 text ({err.reason} at byte {err.start} of a block)") from None
    except OSError as err:
        raise _unreadable(path, err) from None
    if lines:
        yield _joined(lines)


def _joined(lines: list[str]) -> str:
    text = "".join(lines)
    return text[:-1] if text.endswith("\n") else text


def _jsonl_documents(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"data: {path} line {number}: not JSON ({err.msg})") from None
                text = record.get(TEXT_FIELD) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"data: {path} line {number}: expected an object with a {TEXT_FIELD!r} "
                                     f"string, got {line.strip()[:80]!r}")
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as err:
                    raise ValueError(f"data: {path} line {number}: expected a {TEXT_FIELD!r} string of Unicode "
                                     f"text, got the lone surrogate {text[err.start]!r} at character {err.start} "
                                     "(a JSON escape no encoding can store)") from None
                yield text
    except UnicodeDecodeError as err:
        raise ValueError(f"data: {path} is not UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: OSError) -> ValueError:
    return ValueError(f"data: cannot read {path} ({err.strerror or err})")


def _parquet_documents(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"data: reading {path} needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's ArrowInvalid and kin
        raise ValueError(f"data: {path} is not a readable Parquet file ({type(err).__name__}: {err})") from None
    if TEXT_FIELD not in table.schema_arrow.names:
        raise ValueError(f"data: {path}: expected a {TEXT_FIELD!r} column, got columns "
                         f"{', '.join(table.schema_arrow.names)}")
    for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[TEXT_FIELD]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(f"data: {path}: expected a column {TEXT_FIELD!r} of strings, got "
                                 f"{type(text).__name__} {text!r:.80}")
            yield text or ""
