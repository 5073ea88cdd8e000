"""Tokenizers of a run: bytes, a tokenizer.json and an AutoTokenizer directory, each with BOS as one
id of its own on top; errors that name the `tokenizer` setting. Nothing is downloaded."""
import shutil

import numpy as np
import pytest

from shardmoe.train.config import TrainConfig
from shardmoe.train.tokenizer import BOS, VOCAB_SIZE, byte_tokenizer, check_vocab, load_tokenizer, padded_vocab_size

TEXT = "And it came to pass: ünïcode ✓\n\nnext"


def test_bytes_round_trip_utf8_and_drop_bos():
    tokenizer = load_tokenizer("byte")
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.int64 and int(ids.max()) < 256 and list(ids) == list(TEXT.encode())
    assert (tokenizer.vocab_size, tokenizer.bos) == (VOCAB_SIZE, BOS) == (257, 256)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(np.concatenate([[BOS], ids, [BOS]])) == TEXT
    assert tokenizer.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multibyte char does not raise
    with pytest.raises(ValueError, match="ids: expected values in 0..256, got 257"):
        tokenizer.decode([VOCAB_SIZE])


def test_padded_vocab_size():
    assert padded_vocab_size(1) == 257 and padded_vocab_size(64) == 320 and padded_vocab_size(2) == 258
    assert padded_vocab_size(64, 301) == 320 and padded_vocab_size(64, 401) == 448


def test_a_tokenizer_json_round_trips_with_bos_on_top(bpe_tokenizer):
    tokenizer = load_tokenizer(bpe_tokenizer(300))
    assert (tokenizer.vocab_size, tokenizer.bos) == (301, 300)
    ids = tokenizer.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) and ids.max() < 300  # merges; never BOS
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(np.concatenate([[300], ids])) == TEXT
    assert [list(i) for i in tokenizer.encode_batch(["a b", TEXT])] == [list(tokenizer.encode("a b")), list(ids)]
    assert tokenizer.digest != load_tokenizer(bpe_tokenizer(400)).digest


def test_a_directory_is_read_by_autotokenizer_offline(bpe_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=bpe_tokenizer(300))
    fast.save_pretrained(tmp_path / "tok")
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    assert tokenizer.vocab_size == 301
    file_tokenizer = load_tokenizer(bpe_tokenizer(300))
    assert list(tokenizer.encode(TEXT)) == list(file_tokenizer.encode(TEXT))
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_the_model_vocabulary_follows_the_tokenizer_unless_set(bpe_tokenizer):
    assert TrainConfig.from_dict({}).model.vocab_size == 320  # 257 byte ids, padded to a multiple of 64
    assert TrainConfig.from_dict({"tokenizer": bpe_tokenizer(400)}).model.vocab_size == 448  # 401 ids
    given = TrainConfig.from_dict({"tokenizer": bpe_tokenizer(400), "model": {"vocab_size": 512}})
    assert given.model.vocab_size == 512
    check_vocab(401, load_tokenizer(bpe_tokenizer(400)))
    with pytest.raises(ValueError, match=r"model.vocab_size: expected at least the tokenizer .*'s 401 ids \(its tokens "
                                         r"and BOS\), got 400"):
        check_vocab(400, load_tokenizer(bpe_tokenizer(400)))
    with pytest.raises(ValueError, match="model.vocab_size: expected at least the byte tokenizer's 257 ids"):
        check_vocab(256, byte_tokenizer())


@pytest.mark.parametrize("spec, message", [
    ("/nonexistent/tokenizer.json", "tokenizer: no such file or directory '/nonexistent/tokenizer.json' \\(expected "
                                    "'byte', a tokenizer.json file or a directory AutoTokenizer reads\\)"),
    ("TMP/garbage.json", "tokenizer: cannot read 'TMP/garbage.json' as a Hugging Face tokenizer.json file \\("),
    ("TMP/empty", "tokenizer: cannot read the directory 'TMP/empty' with transformers' AutoTokenizer \\("),
    ("/dev/null", "tokenizer: expected 'byte', .* got '/dev/null' \\(a device or other special file\\)"),
    ("", "tokenizer: expected 'byte', a tokenizer.json file or a directory AutoTokenizer reads, got ''"),
])
def test_an_unreadable_tokenizer_is_refused_by_name(tmp_path, spec, message):
    (tmp_path / "garbage.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=message.replace("TMP", str(tmp_path))):
        load_tokenizer(spec.replace("TMP", str(tmp_path)))


def test_the_digest_is_the_content_not_the_place(bpe_tokenizer, tmp_path):
    copy = tmp_path / "elsewhere.json"
    shutil.copy(bpe_tokenizer(300), copy)
    assert load_tokenizer(str(copy)).digest == load_tokenizer(bpe_tokenizer(300)).digest
