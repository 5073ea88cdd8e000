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
