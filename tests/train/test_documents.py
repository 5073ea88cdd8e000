"""Where documents come from and where each format ends one: text, JSONL, Parquet; files,
directories and globs; errors that name `data` and the file."""
import json

import pytest

from shardmoe.train.documents import data_digest, data_files, embedded_corpus, iter_documents, load_corpus


def test_embedded_corpus():
    docs = load_corpus()
    assert len(docs) == 108
    assert docs[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.")
    assert docs[-1].startswith("Jonah 4\n")
    assert all(d and "\n\n" not in d and d.isascii() and not d.endswith("\n") for d in docs)
    assert 200_000 < sum(len(d) + 2 for d in docs) < 500_000
    assert data_files(None) == [embedded_corpus()]


def test_text_documents_end_at_blank_lines_and_a_file_without_one_is_one_document(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nsecond line\n\n\n  \nnext document\n\t\n")
    (tmp_path / "b.md").write_text("one file, no blank line\nstill the same document")
    assert list(iter_documents([tmp_path / "a.txt", tmp_path / "b.md"])) == [
        "first line\nsecond line", "next document", "one file, no blank line\nstill the same document"]


def test_jsonl_documents_are_the_text_field_of_each_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"text": "one\n\ntwo", "id": 1}, {"text": "  "},
                                                      {"text": "three"}]) + "\n\n")
    assert list(iter_documents([path])) == ["one\n\ntwo", "three"]  # whitespace-only text has nothing to train on
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=rf"data: {path} line 2: expected an object with a 'text' string, got "):
        list(iter_documents([path]))
    path.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=rf"data: {path} line 2: not JSON \(Expecting value\)"):
        list(iter_documents([path]))


def test_parquet_documents_are_the_rows_of_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["alpha", None, "beta\ngamma", " "], "n": [1, 2, 3, 4]}), path)
    assert list(iter_documents([path])) == ["alpha", "beta\ngamma"]
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(ValueError, match=rf"data: {path}: expected a 'text' column, got columns body"):
        list(iter_documents([path]))


def test_files_of_a_directory_and_of_a_glob_in_sorted_order(tmp_path):
    for name in ("b/2.txt", "a.jsonl", "b/1.txt", ".hidden/x.txt", "b/.notes"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert data_files(str(tmp_path)) == [tmp_path / "a.jsonl", tmp_path / "b/1.txt", tmp_path / "b/2.txt"]
    assert data_files(str(tmp_path / "**" / "*.txt")) == [tmp_path / "b/1.txt", tmp_path / "b/2.txt"]
    assert data_files(str(tmp_path / "a.jsonl")) == [tmp_path / "a.jsonl"]


def test_a_path_that_exists_is_itself_even_when_its_name_is_a_glob(tmp_path):
    """notes[1].txt beside notes1.txt is the file notes[1].txt (read as a glob, it was notes1.txt),
    and the directory corpus[v2] its files (as a glob it matched nothing); a name that does not
    exist is still a glob."""
    for name in ("notes[1].txt", "notes1.txt", "corpus[v2]/a.txt", "corpusv/a.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    assert data_files(str(tmp_path / "notes[1].txt")) == [tmp_path / "notes[1].txt"]
    assert data_files(str(tmp_path / "corpus[v2]")) == [tmp_path / "corpus[v2]" / "a.txt"]
    assert data_files(str(tmp_path / "notes[0-9].txt")) == [tmp_path / "notes1.txt"]


@pytest.mark.parametrize("data, message", [
    ("TMP/absent.txt", "data: no such file or directory 'TMP/absent.txt'"),
    ("TMP/empty", "data: the directory 'TMP/empty' holds no files"),
    ("TMP/*.parquet", "data: no files match 'TMP/\\*.parquet'"),
    ("/dev/null", "data: expected a file, a directory or a glob pattern, got '/dev/null' \\(a device or other special"),
    ("", "data: expected a file, a directory or a glob pattern \\(or null for the embedded corpus\\), got ''"),
    (7, "data: expected a file, .* got 7"),
])
def test_data_that_names_nothing_readable_is_refused_by_name(tmp_path, data, message):
    (tmp_path / "empty").mkdir()
    data = data.replace("TMP", str(tmp_path)) if isinstance(data, str) else data
    with pytest.raises(ValueError, match=message.replace("TMP", str(tmp_path))):
        data_files(data)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"data: {path} is not UTF-8 text"):
        list(iter_documents([path]))


def test_a_jsonl_string_holding_a_lone_surrogate_is_named_with_its_line(tmp_path):
    """JSON escapes a surrogate that no encoding stores; the tokenizers raised a TypeError (a
    tokenizer.json) or a UnicodeEncodeError naming neither file nor line (bytes)."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "ab\\ud800cd"}\n')
    with pytest.raises(ValueError, match=rf"^data: {path} line 2: expected a 'text' string of Unicode text, got the "
                                         r"lone surrogate '\\ud800' at character 2"):
        list(iter_documents([path]))


def test_a_file_that_cannot_be_read_is_named(tmp_path):
    (tmp_path / "dir.txt").mkdir()
    with pytest.raises(ValueError, match=rf"^data: cannot read {tmp_path / 'dir.txt'} \(Is a directory\)"):
        list(iter_documents([tmp_path / "dir.txt"]))
    with pytest.raises(ValueError, match=rf"^data: cannot read {tmp_path / 'dir.txt'} \(Is a directory\)"):
        data_digest([tmp_path / "dir.txt"])


def test_the_digest_follows_content_format_and_order_not_place(tmp_path):
    (tmp_path / "x").mkdir()
    for folder in (tmp_path, tmp_path / "x"):
        (folder / "a.txt").write_text("alpha")
        (folder / "b.txt").write_text("beta")
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    assert data_digest([a, b]) == data_digest([tmp_path / "x" / "a.txt", tmp_path / "x" / "b.txt"])
    assert data_digest([a, b]) != data_digest([b, a])
    (tmp_path / "a.jsonl").write_text("alpha")
    assert data_digest([a]) != data_digest([tmp_path / "a.jsonl"])
    digest = data_digest([a])
    a.write_text("alphA")
    assert data_digest([a]) != digest
