"""Expert-sorted rows: the layout every stage of the MoE layer works on, and its dtype rule.

A dispatched matrix holds N rows, one per kept (token, expert) pair, grouped by expert (expert
e's rows are contiguous, in token order). Groups says where each expert's rows start and end;
accumulation_dtype says in which dtype sums over rows and routing math run. Both the torch stages
(shardmoe/moe/) and the Triton kernels (shardmoe/kernels/) take them, so they live here, below
both: neither package imports the other for them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routing math and reductions run in float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Groups:
    """Expert e owns rows [start_e, start_e + size_e) of the dispatched matrix.

    counts [E] (the sizes) and offsets [E] (int32, their cumulative ends, as grouped_mm and the
    Triton kernels read them) live on the rows' device; `sizes`, the same counts as a host tuple,
    is read from the device the first time something asks for it (the CPU loops over experts do;
    the GPU paths never do, so a step on them waits for no copy to the host). num_rows, N, is
    given when the caller knows it without reading the counts (a dropless step: S k) and read
    from them otherwise.

    row_tile T > 0 pads expert groups to whole tiles in the GEMMs that map rows to rows (the
    forward GEMMs and the input-gradient GEMMs, per-expert loop only): expert e's GEMM runs on
    the ceil(size_e / T) * T rows from start_e, so fresh routing reuses a few GEMM shapes (a bf16
    GEMM of a new row count costs oneDNN a kernel build). The rows past an expert's own are the
    next experts' rows or the slack a workspace buffer carries past its end: their products land
    in rows that the later experts' GEMMs overwrite (experts run in order) or in that slack, and
    an output row depends on its own input row only, so no pad row reaches a result. A GEMM runs
    on exact counts when an operand's storage lacks the rows (a buffer not from a workspace).
    Weight-gradient GEMMs reduce over rows and take exact counts here (the side-by-side GEMMs of
    cpu_gemm.py, which row tiles turn off, pad them with zero rows in bf16 instead)."""

    counts: torch.Tensor
    offsets: torch.Tensor
    row_tile: int = 0
    given_rows: int | None = None

    @classmethod
    def from_counts(cls, counts: torch.Tensor, row_tile: int = 0, num_rows: int | None = None) -> "Groups":
        """counts [E] rows per expert (any integer dtype, on the rows' device); num_rows their sum
        when the caller knows it without reading them."""
        if row_tile < 0:
            raise ValueError(f"row_tile: expected >= 0, got {row_tile}")
        if num_rows is not None and num_rows < 0:
            raise ValueError(f"num_rows: expected >= 0, got {num_rows}")
        return cls(counts, torch.cumsum(counts, 0).to(torch.int32), row_tile, num_rows)

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """Rows per expert on the host (a copy from the device, made once)."""
        return tuple(int(c) for c in self.counts.tolist())

    @functools.cached_property
    def num_rows(self) -> int:
        """N = sum of the sizes: as given, else read from the counts."""
        return sum(self.sizes) if self.given_rows is None else self.given_rows

    def expert_rows(self, rows: torch.Tensor, out: torch.Tensor):
        """(e, rows of e, out rows of e) for every expert in order, both extended to whole row tiles
        when row_tile > 0 and both storages hold the extra rows (see the class docstring)."""
        start = 0
        for e, size in enumerate(self.sizes):
            padded = -(-size // self.row_tile) * self.row_tile if self.row_tile else size
            if padded > size and _holds_rows(rows, start + padded) and _holds_rows(out, start + padded):
                yield e, _row_view(rows, start, padded), _row_view(out, start, padded)
            else:
                yield e, rows[start:start + size], out[start:start + size]
            start += size

    def row_expert(self, device=None) -> torch.Tensor:
        """[N] expert index of each row (on the counts' device unless `device` says otherwise)."""
        counts = self.counts.to(device) if device is not None else self.counts
        return torch.repeat_interleave(torch.arange(self.num_experts, device=counts.device), counts,
                                       output_size=self.num_rows)


def row_tile_for(dtype: torch.dtype, counts: torch.Tensor) -> int:
    """The row tile of tile-padded expert groups for rows of `dtype`, counts [E] rows per expert,
    when a workspace asks for the rule (Workspace(row_tile=None); the default is no tile: in the
    whole layer tiles did not pay on the CPU measured, docs/history/cpu-layer-choices.md).

    Probed (`python -m shardmoe.bench.tile_probe`, docs/history/cpu-layer-choices.md): only bf16/fp16 GEMMs pay
    for a new row count (oneDNN builds a kernel per shape; fp32 goes to MKL, which does not), and
    padding costs about T/2 extra rows per expert, so the tile is a power of two near 1/32 of the
    mean rows per expert, between 8 and 64: 32 at ~1000 rows per expert, 8 at ~128; 0 below 64
    rows per expert and for other dtypes."""
    if dtype not in (torch.bfloat16, torch.float16) or counts.numel() == 0:
        return 0
    mean_rows = int(counts.sum()) / counts.numel()
    if mean_rows < 64:  # a tile of 8 would add ~6 % rows or more
        return 0
    return max(8, min(64, 1 << int(mean_rows / 32).bit_length() - 1))


def _holds_rows(t: torch.Tensor, num_rows: int) -> bool:
    """Whether t's storage holds num_rows rows of t's layout from t's first row."""
    last = t.storage_offset() + (num_rows - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1)
    return (last + 1) * t.element_size() <= t.untyped_storage().nbytes()


def _row_view(t: torch.Tensor, start: int, num_rows: int) -> torch.Tensor:
    """Rows [start, start + num_rows) of t's layout, which may reach past t.shape[0] (_holds_rows)."""
    return t.as_strided((num_rows, t.shape[1]), t.stride(), t.storage_offset() + start * t.stride(0))
