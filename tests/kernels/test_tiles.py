"""The row-tiled GEMMs' grouped tile order (kernels/tiles.grouped_tile) against its host twin
(kernels/schedule.grouped_tile, the order the traffic model walks): the same (row tile, column tile)
for every program, each tile exactly once, and the programs side by side sharing their tiles. And
tiles.vector_operand, the bias sums' matrix-vector product on the MMA, to twice bfloat16's precision."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from shardmoe.kernels import schedule  # noqa: E402
from shardmoe.kernels.tiles import VECTOR_COLUMNS, dot_acc, grouped_tile, vector_operand  # noqa: E402
from shardmoe.kernels.tuning import dot_settings  # noqa: E402


@triton.jit
def _tile_of_program(out_ptr, row_tiles, col_tiles, group_rows):
    pid = tl.program_id(0)
    row, col = grouped_tile(pid, row_tiles, col_tiles, group_rows)
    tl.store(out_ptr + 2 * pid, row)
    tl.store(out_ptr + 2 * pid + 1, col)


# an uneven last group (7 rows in groups of 3), one group, more groups than columns, column tile fastest
SHAPES = [(7, 5, 3), (4, 6, 8), (9, 2, 2), (5, 3, 1)]


@pytest.mark.parametrize("row_tiles,col_tiles,group_rows", SHAPES)
def test_kernel_order_is_the_host_order_and_covers_every_tile_once(device, row_tiles, col_tiles, group_rows):
    programs = row_tiles * col_tiles
    out = torch.full((programs, 2), -1, dtype=torch.int32, device=device)
    _tile_of_program[(programs,)](out, row_tiles, col_tiles, group_rows)
    host = [schedule.grouped_tile(pid, row_tiles, col_tiles, group_rows) for pid in range(programs)]
    assert out.cpu().tolist() == [list(t) for t in host]
    assert sorted(host) == [(r, c) for r in range(row_tiles) for c in range(col_tiles)]


def test_group_rows_one_walks_the_column_tile_fastest_and_groups_share_tiles():
    assert [schedule.grouped_tile(p, 3, 4, 1) for p in range(8)] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                                     (1, 0), (1, 1), (1, 2), (1, 3)]
    # 16 row tiles by 20 column tiles in groups of 8: the first 16 programs read 8 row tiles and 2 column
    # tiles, where the row tile fastest over all rows would read 16 row tiles and 1 column tile
    first = [schedule.grouped_tile(p, 16, 20, 8) for p in range(16)]
    assert {r for r, _ in first} == set(range(8)) and {c for _, c in first} == {0, 1}


@triton.jit
def _matrix_vector(a_ptr, v_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, DOT_FP32: tl.constexpr,
                   PRECISION: tl.constexpr):
    rows, cols = tl.arange(0, ROWS), tl.arange(0, COLS)
    a = tl.load(a_ptr + rows[:, None] * COLS + cols[None, :])
    v = tl.load(v_ptr + cols)
    acc = dot_acc(a, vector_operand(v, a.dtype), tl.zeros((ROWS, VECTOR_COLUMNS), dtype=tl.float32), DOT_FP32,
                  PRECISION)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))


def test_vector_operand_carries_the_vector_to_twice_bfloat16_precision(device):
    """a v for bfloat16 a [16, 32] and float32 v as the MMA's sum(a @ vector_operand(v)): v's bfloat16
    rounding (2^-9 relative) is carried in the operand's second column, so the product is within
    2^-14 of float64's (without that column it is 2^-10 off or more)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
    v = torch.rand(32, generator=gen) + 0.5  # routing-weight-like scales, far from bfloat16 values
    out = torch.empty(16, dtype=torch.float32, device=device)
    _matrix_vector[(1,)](a.to(device), v.to(device), out, ROWS=16, COLS=32, **dot_settings(torch.bfloat16))
    expected = a.double() @ v.double()
    rounded = a.double() @ v.to(torch.bfloat16).double()
    assert (rounded - expected).abs().max() > 2 ** -10 * expected.abs().max()  # what the second column repairs
    assert (out.double().cpu() - expected).abs().max() < 2 ** -14 * expected.abs().max()
