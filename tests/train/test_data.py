import pytest
import torch

from shardmoe.train import (BOS, VOCAB_SIZE, DataPosition, PackedBatches, decode, encode, load_corpus,
                            padded_vocab_size, split_documents)

DOCS = ["In the beginning.", "And it was so.\nA second line.", "Amen", "x" * 40, "Naïve — ✓ UTF-8", "end"]


def test_tokenizer_round_trips_utf8_and_drops_bos():
    text = "Let there be light: ünïcode ✓\n"
    ids = encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert decode(ids) == text
    assert decode(torch.cat([torch.tensor([BOS]), ids, torch.tensor([BOS])])) == text
    assert decode(torch.tensor([0xE2, 0x9C])) == "\ufffd"  # a cut multibyte char does not raise
    with pytest.raises(ValueError, match="ids"):
        decode(torch.tensor([VOCAB_SIZE]))


def test_padded_vocab_size():
    assert VOCAB_SIZE == 257 and padded_vocab_size(1) == 257
    assert padded_vocab_size(64) == 320 and padded_vocab_size(2) == 258


def test_embedded_corpus():
    docs = load_corpus()
    assert len(docs) == 108
    assert docs[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.")
    assert docs[-1].startswith("Jonah 4\n")
    assert all(d and "\n\n" not in d and d.isascii() for d in docs)
    assert 200_000 < sum(len(d) + 2 for d in docs) < 500_000


def test_split_is_disjoint_complete_and_seeded():
    docs = load_corpus()
    train, val = split_documents(docs, val_fraction=0.05, seed=0)
    assert len(val) == 5 and len(train) == 103
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert split_documents(docs, 0.05, seed=0) == (train, val)
    assert split_documents(docs, 0.05, seed=1)[1] != val


def test_a_split_that_leaves_nothing_to_train_on_is_refused():
    """val_fraction 0.999 passed the config checks and crashed at step 1 (torch.cat of no rows),
    leaving an empty metrics.jsonl that blocked a rerun."""
    docs = load_corpus()
    with pytest.raises(ValueError, match=r"val_fraction: expected a fraction that leaves documents to train on, got "
                                         r"0.999: it holds out 108 of the corpus's 108 documents"):
        split_documents(docs, val_fraction=0.999)


def stream_of(documents, order):
    return torch.cat([torch.cat([torch.tensor([BOS]), encode(documents[i])]) for i in order])


def test_unshuffled_rows_tile_the_stream_with_stride_l():
    data = PackedBatches(DOCS, seq_len=8, batch_size=2, shuffle=False)
    stream = stream_of(DOCS, range(len(DOCS)))
    batches = list(data.epoch_batches(0))
    ids = torch.cat([b.ids for b in batches]).reshape(-1)
    targets = torch.cat([b.targets for b in batches]).reshape(-1)
    assert torch.equal(ids, stream[: ids.numel()])
    assert torch.equal(targets, stream[1: ids.numel() + 1])
    n_rows = (stream.numel() - 1) // 8
    assert data.batches_per_epoch == n_rows // 2 == len(batches)


def test_packing_invariants_on_shuffled_epochs():
    data = PackedBatches(DOCS, seq_len=7, batch_size=3, seed=5)
    for _ in range(3 * data.batches_per_epoch):
        batch = next(data)
        assert batch.ids.shape == batch.targets.shape == batch.is_seq_start.shape == (3, 7)
        assert torch.equal(batch.ids[:, 1:], batch.targets[:, :-1])
        assert batch.is_seq_start[:, 0].all()
        assert torch.equal(batch.is_seq_start[:, 1:], batch.ids[:, 1:] == BOS)
    # An epoch's rows are its seeded document order, tiled and then shuffled.
    for epoch in range(3):
        order = data.document_order(epoch)
        assert sorted(order) == list(range(len(DOCS)))
        tiled = stream_of(DOCS, order).unfold(0, 8, 7)
        assert sorted(map(tuple, data._rows(epoch).tolist())) == sorted(map(tuple, tiled.tolist()))
    assert len({tuple(data.document_order(e)) for e in range(3)}) > 1


def test_epochs_reorder_documents_and_seeds_differ():
    a = PackedBatches(load_corpus(), seq_len=64, batch_size=4, seed=0)
    b = PackedBatches(load_corpus(), seq_len=64, batch_size=4, seed=1)
    first = next(a).ids
    assert not torch.equal(first, next(b).ids)
    assert not torch.equal(a.batch_at(DataPosition(0, 0)).ids, a.batch_at(DataPosition(1, 0)).ids)
    assert torch.equal(first, PackedBatches(load_corpus(), seq_len=64, batch_size=4, seed=0).batch_at(DataPosition(0, 0)).ids)


def test_resume_reproduces_the_batches_across_an_epoch_boundary():
    data = PackedBatches(DOCS, seq_len=5, batch_size=2, seed=3)
    for _ in range(data.batches_per_epoch - 2):
        next(data)
    state = data.state_dict()
    expected = [next(data) for _ in range(5)]  # crosses into epoch 1

    resumed = PackedBatches(DOCS, seq_len=5, batch_size=2, seed=3)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert resumed.position == data.position and resumed.position.epoch == 1


def test_resume_rejects_other_settings():
    state = PackedBatches(DOCS, seq_len=5, batch_size=2, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PackedBatches(DOCS, seq_len=5, batch_size=2, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        PackedBatches(DOCS, seq_len=6, batch_size=2, seed=3).load_state_dict(state)


def test_data_parallel_ranks_partition_the_global_batch():
    whole = PackedBatches(DOCS, seq_len=6, batch_size=4, seed=2)
    ranks = [PackedBatches(DOCS, seq_len=6, batch_size=4, seed=2, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        batch = next(whole)
        parts = [next(r) for r in ranks]
        assert torch.equal(torch.cat([p.ids for p in parts]), batch.ids)
        assert torch.equal(torch.cat([p.is_seq_start for p in parts]), batch.is_seq_start)
    with pytest.raises(ValueError, match="dp_size"):
        PackedBatches(DOCS, seq_len=6, batch_size=3, dp_size=2)
