import torch

from shardmoe.model import attention_mask, packed_layout
from shardmoe.model.segments import sequence_starts


def test_segment_ids_and_positions_restart_at_each_start(packed_starts):
    layout = packed_layout(packed_starts)
    assert layout.segment_ids.tolist() == [[1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3],
                                           [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2]]
    assert layout.positions.tolist() == [[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5],
                                         [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1]]


def test_mask_is_causal_and_within_segment(packed_starts):
    segment_ids = packed_layout(packed_starts).segment_ids
    allowed = attention_mask(segment_ids)
    for b in range(2):
        for i in range(11):
            for j in range(11):
                expected = j <= i and segment_ids[b, i] == segment_ids[b, j]
                assert allowed[b, i, j].item() == expected
    assert allowed.diagonal(dim1=1, dim2=2).all()


def test_rejects_non_bool_flags():
    try:
        packed_layout(torch.zeros(2, 3, dtype=torch.long))
    except ValueError as err:
        assert "is_seq_start" in str(err)
    else:
        raise AssertionError("expected a ValueError")


def test_sequence_starts_cut_at_documents_and_rows():
    """The MoE sequence-wise loss's sequences: each row's first token and each document start."""
    is_seq_start = torch.tensor([[False, False, True, False], [True, False, False, True]])
    assert sequence_starts(packed_layout(is_seq_start).segment_ids).tolist() == [0, 2, 4, 7]
