"""Packed sequences: segment ids, per-segment positions and the attention mask.

A row of L tokens may hold several documents. `is_seq_start[B L]` flags each document's first
token; from it:
- segment_ids[B L] = cumsum(is_seq_start) along L (tokens before the first flag form segment 0);
- positions[B L]: the distance to the segment's first token, so RoPE restarts at 0 for every
  document;
- the attention mask: query i may attend key j iff j <= i and segment_ids[i] == segment_ids[j].
Every query may attend at least itself, so no softmax row is empty.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class PackedLayout(NamedTuple):
    segment_ids: Tensor  # B L int64
    positions: Tensor    # B L int64


def packed_layout(is_seq_start: Tensor) -> PackedLayout:
    """Segment ids and per-segment positions of `is_seq_start[B L]` (bool)."""
    if is_seq_start.dtype != torch.bool or is_seq_start.dim() != 2:
        raise ValueError(f"is_seq_start: expected a bool tensor [B L], got {is_seq_start.dtype} "
                         f"{list(is_seq_start.shape)}")
    starts = is_seq_start.long()
    segment_ids = starts.cumsum(dim=1)
    index = torch.arange(is_seq_start.shape[1], device=is_seq_start.device).expand_as(starts)
    # The latest flagged index at or before each token; 0 when nothing is flagged yet.
    segment_start = torch.where(is_seq_start, index, 0).cummax(dim=1).values
    return PackedLayout(segment_ids, index - segment_start)


def attention_mask(segment_ids: Tensor) -> Tensor:
    """allowed[B L(query) L(key)]: causal and within the query's own segment."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same_segment & causal


def sequence_starts(segment_ids: Tensor) -> Tensor:
    """Offsets into the flattened [B L] tokens where a sequence of the MoE's sequence-wise loss
    begins: every row's first token and every token whose segment differs from its left neighbour's
    (a document cut by a row boundary counts as two sequences, one per row). [B L] -> [Q] int64."""
    begins = torch.ones_like(segment_ids, dtype=torch.bool)
    begins[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return begins.reshape(-1).nonzero().flatten()
