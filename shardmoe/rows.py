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
    from them otherwise."""

    counts: torch.Tensor
    offsets: torch.Tensor
    given_rows: int | None = None

    @classmethod
    def from_counts(cls, counts: torch.Tensor, num_rows: int | None = None) -> "Groups":
        """counts [E] rows per expert (any integer dtype, on the rows' device); num_rows their sum
        when the caller knows it without reading them."""
        if num_rows is not None and num_rows < 0:
            raise ValueError(f"num_rows: expected >= 0, got {num_rows}")
        return cls(counts, torch.cumsum(counts, 0).to(torch.int32), num_rows)

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
        """(e, rows of e, out rows of e) for every expert in order."""
        start = 0
        for e, size in enumerate(self.sizes):
            yield e, rows[start:start + size], out[start:start + size]
            start += size

    def row_expert(self, device=None) -> torch.Tensor:
        """[N] expert index of each row (on the counts' device unless `device` says otherwise)."""
        counts = self.counts.to(device) if device is not None else self.counts
        return torch.repeat_interleave(torch.arange(self.num_experts, device=counts.device), counts,
                                       output_size=self.num_rows)
