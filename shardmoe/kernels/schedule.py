"""Host-side tile schedules for grouped GEMMs over expert-sorted rows.

Expert e owns rows [start_e, start_e + sizes[e]) of the dispatched matrix (Groups).
A row-tiled grouped GEMM launches one program per (row tile, column tile); the row
tiles never straddle two experts, so each program multiplies by one expert's weight.
The schedule maps a program's row-tile id to that expert and row range:

  schedule[i] = (expert, row_start, row_end)      int32 [T, 3]
  T = sum_e ceil(sizes[e] / BLOCK_M)              (empty experts contribute no tile)

Rows row_start .. min(row_start + BLOCK_M, row_end) - 1 belong to tile i; row_end is
the expert's last row + 1, so a tile's mask is `row < row_end`. Building it on the host
costs nothing extra: Groups.sizes is already a host tuple.
"""
from __future__ import annotations

import functools

import torch

MIN_BLOCK_M = 16  # tl.dot needs every tile dim >= 16
MAX_BLOCK_M = 128


def choose_block_m(sizes: tuple[int, ...]) -> int:
    """Rows per tile: the power of two nearest above the mean non-empty group size,
    clamped to [16, 128]. Small groups (many experts, few tokens) get short tiles, so
    little of each tile is padding; large groups get tall tiles, so each weight tile
    loaded is reused by more rows."""
    nonempty = [s for s in sizes if s > 0]
    if not nonempty:
        return MIN_BLOCK_M
    mean = sum(nonempty) / len(nonempty)
    block = MIN_BLOCK_M
    while block < mean and block < MAX_BLOCK_M:
        block *= 2
    return block


@functools.lru_cache(maxsize=64)
def _schedule_cached(sizes: tuple[int, ...], block_m: int, device: torch.device) -> torch.Tensor:
    entries = []
    start = 0
    for expert, size in enumerate(sizes):
        end = start + size
        entries.extend((expert, row, end) for row in range(start, end, block_m))
        start = end
    table = torch.tensor(entries, dtype=torch.int32).reshape(-1, 3)
    return table.to(device)


def row_tile_schedule(sizes: tuple[int, ...], block_m: int, device: torch.device) -> torch.Tensor:
    """int32 [T, 3] of (expert, row_start, row_end), one entry per BLOCK_M row tile.

    Cached by (sizes, block_m, device): the forward and the backward of one layer,
    and the several kernels of each, share one host-to-device copy."""
    return _schedule_cached(tuple(sizes), block_m, torch.device(device))


@functools.lru_cache(maxsize=64)
def _bounds_cached(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return torch.tensor(bounds, dtype=torch.int32).to(device)


def group_bounds(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [E + 1]: expert e owns rows [bounds[e], bounds[e + 1])."""
    return _bounds_cached(tuple(sizes), torch.device(device))
