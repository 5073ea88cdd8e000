"""Packed batches read from a token stream: rows, their order, positions, resume, data parallelism."""
import numpy as np
import pytest
import torch

from shardmoe.train import BOS, DataPosition, PackedBatches, byte_tokenizer, shuffled_index
from shardmoe.train.data import document_prompts

DOCS = ["In the beginning.", "And it was so.\nA second line.", "Amen", "x" * 40, "Naïve — ✓ UTF-8", "end"]


def stream_of(documents) -> np.ndarray:
    """[BOS, bytes...] of every document, concatenated (what the token cache writes)."""
    tokenizer = byte_tokenizer()
    return np.concatenate([np.concatenate([[BOS], tokenizer.encode(d)]) for d in documents]).astype(np.uint16)


def packed(documents=DOCS, **options) -> PackedBatches:
    return PackedBatches(stream_of(documents), bos=BOS, **options)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 1023])
def test_shuffled_index_is_a_permutation_chosen_by_its_key(n):
    order = [shuffled_index(i, n, "rows:0:0") for i in range(n)]
    assert sorted(order) == list(range(n))
    if n > 6:
        assert order != list(range(n)) and order != [shuffled_index(i, n, "rows:0:1") for i in range(n)]
    with pytest.raises(ValueError, match=f"i: expected an index in 0..{n - 1}, got {n}"):
        shuffled_index(n, n, "k")


def test_unshuffled_rows_tile_the_stream_with_stride_l():
    data = packed(seq_len=8, batch_size=2, shuffle=False)
    stream = torch.from_numpy(stream_of(DOCS).astype(np.int64))
    batches = list(data.epoch_batches(0))
    ids = torch.cat([b.ids for b in batches]).reshape(-1)
    targets = torch.cat([b.targets for b in batches]).reshape(-1)
    assert torch.equal(ids, stream[: ids.numel()])
    assert torch.equal(targets, stream[1: ids.numel() + 1])
    n_rows = (stream.numel() - 1) // 8
    assert data.num_rows == n_rows and data.batches_per_epoch == n_rows // 2 == len(batches)


def test_packing_invariants_on_shuffled_epochs():
    data = packed(seq_len=7, batch_size=3, seed=5)
    stream = torch.from_numpy(stream_of(DOCS).astype(np.int64))
    orders = []
    for epoch in range(3):
        order = [data.row_index(epoch, slot) for slot in range(3 * data.batches_per_epoch)]
        for b in range(data.batches_per_epoch):
            batch = next(data)
            assert batch.ids.shape == batch.targets.shape == batch.is_seq_start.shape == (3, 7)
            assert batch.ids.dtype == torch.int64
            assert torch.equal(batch.ids[:, 1:], batch.targets[:, :-1])
            assert batch.is_seq_start[:, 0].all()
            assert torch.equal(batch.is_seq_start[:, 1:], batch.ids[:, 1:] == BOS)
            for row, r in zip(torch.cat([batch.ids, batch.targets[:, -1:]], 1), order[3 * b: 3 * b + 3]):
                assert torch.equal(row, stream[7 * r: 7 * r + 8])  # stream row r, stride L, width L + 1
        # an epoch serves distinct rows, all of them but the leftover after its last whole batch
        assert len(set(order)) == len(order) and set(order) <= set(range(data.num_rows))
        orders.append(order)
    assert data.position == DataPosition(3, 0)
    assert len({tuple(o) for o in orders}) == 3  # every epoch another order


def test_seeds_differ_and_a_stream_is_a_pure_function_of_its_settings():
    a = packed(seq_len=5, batch_size=2, seed=0)
    b = packed(seq_len=5, batch_size=2, seed=1)
    first = next(a).ids
    assert not torch.equal(first, next(b).ids)
    assert not torch.equal(a.batch_at(DataPosition(0, 0)).ids, a.batch_at(DataPosition(1, 0)).ids)
    assert torch.equal(first, packed(seq_len=5, batch_size=2, seed=0).batch_at(DataPosition(0, 0)).ids)


def test_resume_reproduces_the_batches_across_an_epoch_boundary():
    data = packed(seq_len=5, batch_size=2, seed=3)
    for _ in range(data.batches_per_epoch - 2):
        next(data)
    state = data.state_dict()
    expected = [next(data) for _ in range(5)]  # crosses into epoch 1

    resumed = packed(seq_len=5, batch_size=2, seed=3)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert resumed.position == data.position and resumed.position.epoch == 1


def test_resume_rejects_other_settings_and_other_data():
    state = packed(seq_len=5, batch_size=2, seed=3, source="abc").state_dict()
    with pytest.raises(ValueError, match="seed"):
        packed(seq_len=5, batch_size=2, seed=4, source="abc").load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        packed(seq_len=6, batch_size=2, seed=3, source="abc").load_state_dict(state)
    with pytest.raises(ValueError, match="data state: source was 'abc' when saved, this stream has 'xyz'"):
        packed(seq_len=5, batch_size=2, seed=3, source="xyz").load_state_dict(state)


def test_data_parallel_ranks_partition_the_global_batch_reading_only_their_rows():
    whole = packed(seq_len=6, batch_size=4, seed=2)
    ranks = [packed(seq_len=6, batch_size=4, seed=2, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(3):
        batch = next(whole)
        parts = [next(r) for r in ranks]
        assert torch.equal(torch.cat([p.ids for p in parts]), batch.ids)
        assert torch.equal(torch.cat([p.is_seq_start for p in parts]), batch.is_seq_start)
    read = []
    rank = ranks[1]
    rank.row = lambda r, read_row=rank.row: read.append(r) or read_row(r)
    next(rank)
    assert len(read) == 2  # its two rows of the global batch of four, nothing else
    with pytest.raises(ValueError, match="dp_size"):
        packed(seq_len=6, batch_size=3, dp_size=2)


def test_a_stream_shorter_than_a_batch_is_refused():
    with pytest.raises(ValueError, match="the documents hold 6 tokens, fewer than one batch of 2 rows of 4 tokens"):
        packed(["hello"], seq_len=4, batch_size=2)


def test_document_prompts_are_the_starts_of_the_first_documents():
    stream = stream_of(DOCS)
    prompts = document_prompts(stream, BOS, 3, 6)
    assert [byte_tokenizer().decode(p) for p in prompts] == ["In the", "And it", "Amen"]
    assert len(document_prompts(stream, BOS, 10, 4)) == len(DOCS)
