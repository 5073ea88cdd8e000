"""The token cache: what an entry holds, when it is built and reused, the held-out split, and a
run whose peak memory does not grow with the corpus."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import shardmoe
from shardmoe.train import token_cache
from shardmoe.train.documents import load_corpus
from shardmoe.train.token_cache import held_out_documents, open_tokens
from shardmoe.train.tokenizer import BOS, load_tokenizer

from .conftest import generated_documents, tiny_train_config

BYTES = load_tokenizer("byte")


def documents_of(stream: np.ndarray, tokenizer=BYTES) -> list[str]:
    """The documents of a stream, split at BOS."""
    starts = list(np.flatnonzero(stream == tokenizer.bos)) + [stream.size]
    return [tokenizer.decode(stream[a + 1: b]) for a, b in zip(starts, starts[1:])]


def test_an_entry_holds_the_split_documents_as_bos_separated_streams(tmp_path):
    tokens = open_tokens(None, BYTES, 0.05, tmp_path)
    docs = load_corpus()
    held = held_out_documents(len(docs), 0.05)
    assert len(held) == 5  # of the 108 chapters, the same whatever the run's seed
    assert documents_of(tokens.train) == [d for i, d in enumerate(docs) if i not in held]
    assert documents_of(tokens.val) == [d for i, d in enumerate(docs) if i in held]
    assert tokens.train.dtype == np.uint16 and isinstance(tokens.train, np.memmap)
    assert tokens.meta["train_documents"] == 103 and tokens.meta["val_documents"] == 5
    assert tokens.train.size + tokens.val.size == sum(len(d) + 1 for d in docs)
    assert held_out_documents(len(docs), 0.05, seed=1) != held


def test_a_split_that_leaves_nothing_to_train_on_is_refused():
    with pytest.raises(ValueError, match=r"val_fraction: expected a fraction that leaves documents to train on, got "
                                         r"0.999: it holds out 108 of the data's 108 documents"):
        held_out_documents(108, val_fraction=0.999)


def test_one_document_holds_out_its_tail(tmp_path):
    (tmp_path / "one.txt").write_text("a single paragraph without any blank line\n" * 20)
    tokens = open_tokens(str(tmp_path / "one.txt"), BYTES, 0.1, tmp_path / "cache")
    text = "a single paragraph without any blank line\n" * 20
    train, val = documents_of(tokens.train), documents_of(tokens.val)
    assert train[0] + val[0] == text[:-1] and len(val[0]) == round(0.1 * (len(text) - 1))


def test_a_second_open_reuses_the_entry_and_other_inputs_make_other_entries(tmp_path, monkeypatch, bpe_tokenizer,
                                                                            capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in generated_documents(40)))
    first = open_tokens(str(data), BYTES, 0.1, tmp_path / "cache", progress=True)
    assert "tokenizing (byte)" in capsys.readouterr().err  # the progress bar
    assert open_tokens(str(data), BYTES, 0.1, tmp_path / "cache", progress=True).path == first.path
    assert capsys.readouterr().err == f"token cache: reusing {first.path} ({data} tokenized by byte before)\n"
    copy = tmp_path / "copy" / "data.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(data.read_bytes())

    def never(*args):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as m:
        m.setattr(token_cache, "_build", never)
        assert open_tokens(str(copy), BYTES, 0.1, tmp_path / "cache").path == first.path  # content, not place
    keys = {first.key, open_tokens(str(data), BYTES, 0.2, tmp_path / "cache").key,
            open_tokens(str(data), load_tokenizer(bpe_tokenizer(300)), 0.1, tmp_path / "cache").key}
    data.write_text(data.read_text() + json.dumps({"text": "one more"}) + "\n")
    keys.add(open_tokens(str(data), BYTES, 0.1, tmp_path / "cache").key)
    assert len(keys) == 4
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == sorted(keys)


def test_concurrent_builders_take_turns_and_build_once(tmp_path, monkeypatch):
    builds, real_build = [], token_cache._build

    def slow_build(*args):
        builds.append(1)
        time.sleep(0.3)
        real_build(*args)

    monkeypatch.setattr(token_cache, "_build", slow_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(open_tokens(None, BYTES, 0.05, tmp_path).path))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(results) == 2 and results[0] == results[1]


def test_a_damaged_entry_is_named(tmp_path):
    tokens = open_tokens(None, BYTES, 0.05, tmp_path)
    with open(tokens.path / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=rf"token_cache: {tokens.path} is damaged \(train.bin should hold \d+ bytes\); "
                                         "delete the directory and it is rebuilt"):
        open_tokens(None, BYTES, 0.05, tmp_path)


def test_an_unwritable_cache_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"token_cache: cannot create the token cache in '.*file/cache' \(Not a "
                                         r"directory\)"):
        open_tokens(None, BYTES, 0.05, tmp_path / "file" / "cache")


def test_a_full_disk_while_building_is_one_error_naming_the_cache(tmp_path, monkeypatch):
    """The token files opened on /dev/full, whose writes fail with ENOSPC as a full disk's do: a
    ValueError naming the cache (an OSError traceback before), no entry and no scratch left."""
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        return real_open("/dev/full", mode, *args, **kwargs) if str(path).endswith(".bin") else \
            real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(token_cache, "open", full_disk, raising=False)
    with pytest.raises(ValueError, match=rf"^token_cache: cannot write the token cache in '{tmp_path}' \(No space "
                                         r"left on device\)$"):
        open_tokens(None, BYTES, 0.05, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []


def test_a_tokenizer_that_encodes_a_document_to_nothing_is_refused(tmp_path):
    """A BPE without an unknown token drops what its vocabulary lacks: a document of such text only
    became a lone BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "ab.json"))
    (tmp_path / "data.txt").write_text("ab ba\n\nxyz\n\nabab\n")
    with pytest.raises(ValueError, match=r"^tokenizer: '.*ab.json' encodes document 2 of .*data.txt \(3 characters: "
                                         r"'xyz'\) to no tokens: expected a tokenizer that encodes the data$"):
        open_tokens(str(tmp_path / "data.txt"), load_tokenizer(str(tmp_path / "ab.json")), 0.3, tmp_path / "cache")


PEAK_RSS = """
import resource, sys
from shardmoe.cli import main
code = main(sys.argv[1:])
print(code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB
"""


def peak_rss_kib(config: Path, data: Path, out: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(Path(shardmoe.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, "train", "--config", str(config), "--data", str(data),
                           "--out", str(out), "--no-progress"], env=env, capture_output=True, text=True, timeout=600)
    code, kib = done.stdout.split()[-2:]
    assert code == "0", done.stderr
    return int(kib)


def test_a_runs_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    """A run of 2 steps on a 34 MB corpus and on one 32 times smaller, each tokenized into a fresh
    cache by the run: the larger one's peak RSS (tokenizing, hashing and reading rows from the map
    included) stays within 8 MB of the smaller one's, a quarter of the corpus (its tokens alone
    would be 67 MB as uint16, 270 MB as int64)."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_train_config(steps=2, sample_tokens=4, health_every=0,
                                                   token_cache=str(tmp_path / "cache")).to_dict()))
    block = "\n\n".join(generated_documents(400, sentences=12)) + "\n\n"  # 210 KB, documents of ~525 bytes
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text(block * 5)
    with open(large, "w") as f:
        for _ in range(32 * 5):
            f.write(block)
    assert 30e6 < large.stat().st_size < 40e6
    baseline = peak_rss_kib(config, small, tmp_path / "small-run")
    peak = peak_rss_kib(config, large, tmp_path / "large-run")
    assert peak - baseline < 8 * 1024, (baseline, peak)
