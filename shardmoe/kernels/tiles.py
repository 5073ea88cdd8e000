"""Device helpers shared by the GEMM kernels: where a row tile lies and the accumulating dot."""
import triton
import triton.language as tl


@triton.jit
def row_tile(tile, ends_ptr, num_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """(expert, row_start, row_end) of row tile `tile` of the expert-sorted rows, read from the
    device: ends_ptr holds the groups' cumulative ends [E] (int32; expert e owns rows
    [ends[e-1], ends[e]), ends[-1] = 0), E_PAD >= E is a power of two.

      tiles_e    = ceil(size_e / BLOCK_M)          (an empty expert has none)
      tile_end_e = tiles_0 + ... + tiles_e
      expert     = #{e : tile_end_e <= tile}        (the expert whose tiles hold `tile`)
      row_start  = start_expert + (tile - tile_end_expert + tiles_expert) BLOCK_M
      row_end    = ends[expert]                      (the tile's rows stop there)

    A tile past the last one gets expert >= num_experts: its program has nothing to do. The
    grid can thus be sized without reading the counts, ceil(N / BLOCK_M) + E programs (each
    expert adds at most one partial tile), and no tile straddles two experts."""
    e = tl.arange(0, E_PAD)
    present = e < num_experts
    ends = tl.load(ends_ptr + e, mask=present, other=0)
    starts = tl.load(ends_ptr + e - 1, mask=present & (e > 0), other=0)
    tiles = tl.where(present, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, axis=0)
    expert = tl.sum((tile_end <= tile).to(tl.int32), axis=0)
    this = e == expert
    first_tile = tl.sum(tl.where(this, tile_end - tiles, 0), axis=0)
    row_start = tl.sum(tl.where(this, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(this, ends, 0), axis=0)
    return expert, row_start, row_end


@triton.jit
def grouped_tile(pid, row_tiles, col_tiles, group_rows):
    """(row tile, column tile) of program `pid` of a 1-D launch over row_tiles x col_tiles output
    tiles, in the grouped order of Triton's matmul tutorial (tl.swizzle2d): groups of `group_rows`
    row tiles, and within a group the row tile fastest, then the column tile:

      group     = pid // (group_rows col_tiles),   first = group group_rows
      rows_here = min(row_tiles - first, group_rows)
      row tile  = first + (pid mod group_rows col_tiles) mod rows_here
      col tile  = (pid mod group_rows col_tiles) // rows_here

    The programs running side by side (consecutive pids) then share their row tiles and their
    column tiles, each read from DRAM once per wave; group_rows = 1 walks the column tile fastest.
    schedule.grouped_tile is its host twin."""
    return tl.swizzle2d(pid // col_tiles, pid % col_tiles, row_tiles, col_tiles, group_rows)


@triton.jit
def source_rows(index_ptr, rows, row_mask, GATHER: tl.constexpr):
    """The rows [BLOCK] (int64) an operand is read from for the tile's rows `rows`: index[rows]
    with GATHER (the operand is in token order, read through the row -> token index), else rows."""
    if GATHER:
        out = tl.load(index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        out = rows
    return out


@triton.jit
def expert_rows(expert, ends_ptr):
    """(start, end) of expert `expert`'s rows, from the cumulative ends on the device."""
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(ends_ptr + expert)
    return start, end


VECTOR_COLUMNS = tl.constexpr(16)  # tl.dot's narrowest operand


@triton.jit
def vector_operand(v, dtype):
    """v [n] as the right-hand MMA operand [n, 16] in `dtype`: column 0 holds hi = v rounded to dtype,
    column 1 lo = (v - hi) rounded to dtype, the rest zeros; so sum(a @ vector_operand(v), axis=1) =
    a v with v carried to about twice dtype's precision (exactly v for float32). A row sum or a
    matrix-vector product inside a GEMM's K loop thus runs on the tensor cores from the operand tile
    in shared memory, where a sum in registers would load that tile out of its pipeline buffers."""
    column = tl.arange(0, VECTOR_COLUMNS)[None, :]
    hi = v.to(dtype)
    lo = (v - hi.to(tl.float32)).to(dtype)
    return tl.where(column == 0, hi[:, None], tl.where(column == 1, lo[:, None], 0.0)).to(dtype)


@triton.jit
def dot_acc(a, b, acc, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b with float32 accumulation.

    DOT_FP32 (the interpreter) multiplies in float32; otherwise `a` is rounded to b's
    dtype first, so a float32 tile computed in a prologue meets bfloat16 weights on the
    tensor cores just as the torch path's bfloat16 intermediate would."""
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        out = tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)
    return out
