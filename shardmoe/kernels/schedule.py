"""Launch shapes of the grouped GEMMs over expert-sorted rows, from sizes the host knows.

Expert e owns rows [ends[e-1], ends[e]) of the dispatched matrix (Groups.offsets, int32 [E],
on the device). The kernels read those ends themselves (tiles.row_tile, tiles.expert_rows), so a
launch needs only N (the rows, known without reading the counts in a dropless step: S k) and E:

  row-tiled GEMMs    one program per (row tile, column tile) on a 1-D grid, in grouped order
                     (grouped_tile: GROUP_ROWS row tiles at a time, the row tile fastest within a
                     group), so the programs running together share operand tiles; a row tile holds
                     BLOCK_M rows of one expert, and there are at most ceil(N / BLOCK_M) + E of them
                     (each expert adds at most one partial tile); programs past the last tile return
                     at once
  weight gradients   persistent programs over the E x (output tiles) tiles, each reducing over
                     its expert's rows (the K dimension of that GEMM is the expert's row count)
"""
from __future__ import annotations

import functools

import torch
import triton

# The program axis each kernel's launch takes its output column tile from (the static stage's
# column_axis: python -m shardmoe.tools.gpu_check --only static); None where a program covers every
# column. The hardware starts programs in the order of axis 0 first, so with the column tile on axis 1
# the programs running together share one column tile and each reads a different row tile.
COLUMN_AXIS = {"forward_gemm_kernel": 0, "down_grad_kernel": 0, "grad_gemm_kernel": 0, "weight_grad_kernel": 0,
               "router_gemm_kernel": 0, "token_combine_kernel": 1, "gate_dots_kernel": None}

# Row tiles per group of the row-tiled GEMMs' grouped order (Triton's matmul tutorial takes 8). A wave of
# P programs then covers 8 row tiles by P / 8 column tiles (or, with fewer column tiles, P / col_tiles
# whole row tiles), instead of P row tiles of one column tile; the traffic model (gpu_check --only
# traffic) counts the bytes either way.
GROUP_ROWS = 8

MIN_BLOCK_M = 16  # tl.dot needs every tile dim >= 16
MAX_BLOCK_M = 128
INTERPRETER_PROGRAMS = 3  # persistent programs under the interpreter: more than one, so the tile loop strides


def choose_block_m(num_rows: int, num_experts: int) -> int:
    """Rows per tile: the power of two at or above the mean rows per expert N / E, clamped to
    [16, 128]. Small groups (many experts, few tokens) get short tiles, so little of each tile is
    padding; large groups get tall tiles, so each weight tile loaded is reused by more rows."""
    mean = num_rows / max(num_experts, 1)
    block = MIN_BLOCK_M
    while block < mean and block < MAX_BLOCK_M:
        block *= 2
    return block


def grouped_tile(pid: int, row_tiles: int, col_tiles: int, group_rows: int) -> tuple[int, int]:
    """(row tile, column tile) of program `pid`: tiles.grouped_tile on the host (tl.swizzle2d)."""
    i, j = divmod(pid, col_tiles)
    index, per_group = i * col_tiles + j, group_rows * col_tiles
    first = index // per_group * group_rows
    rows_here = min(row_tiles - first, group_rows)
    index %= per_group
    return first + index % rows_here, index // rows_here


def row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """The row-tiled grid's first dimension: an upper bound on sum_e ceil(size_e / block_m)."""
    return triton.cdiv(num_rows, block_m) + num_experts


MIN_EXPERTS_PAD = 256


def experts_pad(num_experts: int) -> int:
    """E_PAD, the width of the vector tiles.row_tile reads the E ends into: a power of two at or
    above E, and at least 256, so that layers of up to 256 experts share one compiled kernel (E_PAD
    is a constexpr: each value is another compile, and another autotune on a bare GPU)."""
    return max(MIN_EXPERTS_PAD, triton.next_power_of_2(num_experts))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(device: torch.device, tiles: int) -> int:
    """Programs of a persistent kernel: one per multiprocessor (CUDA), never more than its tiles."""
    device = torch.device(device)
    slots = _multiprocessors(device) if device.type == "cuda" else INTERPRETER_PROGRAMS
    return max(1, min(tiles, slots))
