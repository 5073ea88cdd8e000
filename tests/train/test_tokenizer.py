"""Tokenizers of a run: bytes, a tokenizer.json and an AutoTokenizer directory, each with BOS as one
id of its own on top; errors that name the `tokenizer` setting. Nothing is downloaded."""
import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardmoe.train.config import TrainConfig
from shardmoe.train.tokenizer import BOS, VOCAB_SIZE, byte_tokenizer, check_vocab, load_tokenizer, padded_vocab_size

from .conftest import word_level

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


def test_ids_that_are_not_0_to_n_minus_1_are_refused_by_name(tmp_path):
    """Five tokens with the ids 0, 1, 2, 3, 5: 'c' (id 5) was past the 5 ids the model's vocabulary
    covered, and a sixth token with the id 5 would have been read as BOS."""
    spec = word_level(tmp_path / "sparse.json", {"a": 0, "b": 1, "[UNK]": 2, "d": 3, "c": 5})
    with pytest.raises(ValueError, match=r"^tokenizer: '.*sparse.json': expected the ids 0..4 of its 5 tokens, got id 5 "
                                         r"\('c'\) past them and 1 missing \(first 4\)"):
        load_tokenizer(spec)


def test_added_tokens_are_ids_of_their_own_below_bos(tmp_path):
    """An added <|eot|> takes the id after the model's vocabulary: BOS comes after it, and the
    text's <|eot|> encodes to its own id, never to BOS's (leaving the added tokens out of the count
    made BOS the id of <|eot|>)."""
    spec = word_level(tmp_path / "eot.json", {"[UNK]": 0, "a": 1, "b": 2}, added=["<|eot|>"])
    tokenizer = load_tokenizer(spec)
    assert (tokenizer.vocab_size, tokenizer.bos) == (5, 4)
    assert list(tokenizer.encode("a <|eot|> b")) == [1, 3, 2]
    assert tokenizer.decode([1, 3, 4, 2]) == "a <|eot|> b"  # BOS dropped, <|eot|> kept


def test_a_directory_holding_only_a_models_config_is_refused(tmp_path):
    """AutoTokenizer reads a directory holding only a GPT-2 config.json as a tokenizer of one
    special token, which encodes every text to nothing: every document became a lone BOS."""
    pytest.importorskip("transformers")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match=r"^tokenizer: '.*model': expected a vocabulary, got 1 special token\(s\) and "
                                         r"no other, which encode every text to nothing"):
        load_tokenizer(str(tmp_path / "model"))


def test_long_texts_are_encoded_in_pieces_to_the_ids_of_the_whole(bpe_tokenizer, tmp_path, monkeypatch):
    """With pieces of 200 characters, a text of 60 documents on one line encodes in pieces to the ids
    its whole encoding has (a cut at every 200th character gives other ids: the boundaries
    matter), with a byte-level BPE (its words cut apart) and a BPE without a pre-tokenizer (its
    merges cross spaces, so the first places tried are refused), and no call of the tokenizer
    takes more than a piece and its check's context."""
    from tokenizers import Tokenizer as HFTokenizer, models, trainers

    from shardmoe.train import tokenizer as module

    from .conftest import generated_documents

    text = " ".join(d.replace("\n", " ") for d in generated_documents(60))
    no_words = HFTokenizer(models.BPE())  # no pre-tokenizer: merges may cross spaces
    no_words.train_from_iterator(generated_documents(200, seed=1),
                                 trainers.BpeTrainer(vocab_size=400, show_progress=False))
    no_words.save(str(tmp_path / "no-words.json"))
    for spec in (bpe_tokenizer(300), str(tmp_path / "no-words.json")):
        hf = HFTokenizer.from_file(spec)
        whole = hf.encode(text, add_special_tokens=False).ids
        tokenizer = load_tokenizer(spec)
        calls = []
        real = tokenizer._encode_batch
        tokenizer._encode_batch = lambda texts: calls.append(max(map(len, texts))) or real(texts)
        with monkeypatch.context() as m:
            m.setattr(module, "PIECE_CHARS", 200)
            m.setattr(module, "CUT_CONTEXT", 24)
            assert list(tokenizer.encode(text)) == whole, spec
            pieces = list(tokenizer._pieces(text))
        assert "".join(pieces) == text and len(pieces) > len(text) // 400, (spec, len(pieces))
        assert max(calls) <= 200 + 2 * 24 + 40, spec  # a piece runs to the next word's start
        naive = [i for start in range(0, len(text), 200)
                 for i in hf.encode(text[start: start + 200], add_special_tokens=False).ids]
        assert naive != whole, spec


def test_a_tokenizer_files_truncation_and_padding_do_not_cut_or_pad_the_documents(tmp_path):
    """A tokenizer.json may carry the truncation and padding its model was served with (max_length
    512, say): training reads every document whole and unpadded, from the file and from a directory
    AutoTokenizer reads (the file's settings cut each document to max_length and filled the shorter
    ones of a batch with the pad id, silently)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = word_level(tmp_path / "tokenizer.json", {w: i for i, w in enumerate(["[UNK]", "[PAD]", "a", "b", "c"])})
    served = HFTokenizer.from_file(path)
    served.enable_truncation(max_length=3)
    served.enable_padding(pad_id=1, pad_token="[PAD]")
    served.save(path)
    texts = ["a b c a b c a", "c"]
    whole = [[2, 3, 4, 2, 3, 4, 2], [4]]

    def check(spec):
        tokenizer = load_tokenizer(spec)
        assert [list(ids) for ids in tokenizer.encode_batch(texts)] == whole, spec
        assert list(tokenizer.encode(texts[0])) == whole[0], spec

    check(path)
    # its token cache entries are not those of the file's earlier reading, which cut the documents
    assert load_tokenizer(path).digest != hashlib.sha256(Path(path).read_bytes()).hexdigest()
    transformers = pytest.importorskip("transformers")
    transformers.PreTrainedTokenizerFast(tokenizer_file=path).save_pretrained(tmp_path / "tok")
    check(str(tmp_path / "tok"))
