"""The row-tiled GEMMs' grouped tile order (kernels/tiles.grouped_tile) against its host twin
(kernels/schedule.grouped_tile, the order the traffic model walks): the same (row tile, column tile)
for every program, each tile exactly once, and the programs side by side sharing their tiles."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from shardmoe.kernels import schedule  # noqa: E402
from shardmoe.kernels.tiles import grouped_tile  # noqa: E402


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
