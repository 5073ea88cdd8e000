"""The router's float32 GEMMs on tensor cores at float32 accuracy: C = A B.

  C [M, N] float32 = A [M, K] B [K, N],   A and B float32 or bfloat16 (each its own), read through
  their strides (a transposed operand is a view, never a copy) and widened to float32 in registers
  (exact for bfloat16); the product is tl.dot with input_precision="tf32x3": each float32 operand
  split as hi + lo (hi its TF32 rounding, lo the TF32 rounding of the rest), and hi hi + hi lo + lo hi
  summed on the TF32 tensor cores in float32, an error of the order of float32's own (the lo lo
  term, dropped, is 2^-22 of the product) where one TF32 product would carry 2^-11.

The router's three products (moe/routing.py), S tokens, H hidden, E experts:
  logits  x Wg         [S, H] x [H, E]   (x as the layer holds it, bfloat16 included: no float32 copy)
  dx      dlogits Wg^T [S, E] x [E, H]   (Wg^T: gate_weight.t())
  dWg     x^T dlogits  [H, S] x [S, E]   (x^T: x.t(), read column-wise)

E (8..256) is N or K. Each program computes a BLOCK_M x BLOCK_N tile of C, BLOCK_N the power of two
at or above N (at least 16, tl.dot's least), capped at MAX_BLOCK_N, so an E-wide output is one
column tile; program axis 0 walks the column tiles of a row tile first (n fastest), so a row tile of A
is read once however many column tiles there are. A long reduction over a short output (dWg: K = S tokens, C only H x E) is split into
chunks of SPLIT_K_CHUNK: program (m, n, s) sums its chunk into partials [splits, M, N], which are
summed in a fixed order afterwards (no atomics: the result is the same every run). Autotuned over
BLOCK_M, BLOCK_K, warps and stages, keyed on N, the chunk length and A's row stride (which tells
the products apart: 1 for dWg's transposed x), none of which changes with the token count.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardmoe.kernels import KERNEL_DTYPES
from shardmoe.kernels.tuning import autotune, interpreting

MIN_BLOCK_N = 16  # tl.dot needs every tile dim >= 16
MAX_BLOCK_N = 128
INTERPRETER_MAX_BLOCK_N = 32  # several column tiles in the CPU tests' small widths
SPLIT_K_CHUNK = 2048  # reduction length per program when K is longer than M (dWg over the tokens)

# tf32x3 holds four float32 operand tiles (hi and lo of each) besides the accumulator. Compiled for
# sm_90a at the static stage's three layer shapes (E = 8, 32, 128; python -m shardmoe.tools.gpu_check
# --only static), 64 x 32 with 8 warps keeps every product under 255 registers without spills (224 at most,
# dx at E = 8), so it comes first (the config without autotuning); 128 x 32 with 8 warps spills 256
# bytes there and none elsewhere. 128-row tiles with 4 warps (over 2 KB at E = 128) and K tiles of 64
# (dx at E = 8) spill and are left out.
_GPU_TILES = [{"BLOCK_M": m, "BLOCK_K": k} for m, k in ((64, 32), (128, 16), (128, 32))]


@autotune(_GPU_TILES, {"BLOCK_M": 16, "BLOCK_K": 16}, key=["N", "K_CHUNK", "stride_am"],
          warps_stages=((8, 4), (8, 3)))
@triton.jit
def router_gemm_kernel(
    a_ptr, stride_am, stride_ak,
    b_ptr, stride_bk, stride_bn,
    c_ptr, stride_cs, stride_cm,
    M, N, K, K_CHUNK,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[s, m, n] = sum over k in chunk s, [s K_CHUNK, (s + 1) K_CHUNK) within K, of a[m, k] b[k, n]."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // tiles_n
    pid_n = tl.program_id(0) % tiles_n
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    k_start = pid_s * K_CHUNK
    k_end = tl.minimum(K, k_start + K_CHUNK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        ks64 = ks.to(tl.int64)
        a = tl.load(a_ptr + rows64[:, None] * stride_am + ks64[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + ks64[:, None] * stride_bk + cols64[None, :] * stride_bn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")
    c = c_ptr + pid_s.to(tl.int64) * stride_cs + rows64[:, None] * stride_cm + cols64[None, :]
    tl.store(c, acc, mask=row_mask[:, None] & col_mask[None, :])


def block_n(width: int) -> int:
    """BLOCK_N for an output `width` columns wide: the power of two at or above it in [16, MAX_BLOCK_N]
    (INTERPRETER_MAX_BLOCK_N under the interpreter)."""
    cap = INTERPRETER_MAX_BLOCK_N if interpreting() else MAX_BLOCK_N
    return min(max(MIN_BLOCK_N, triton.next_power_of_2(max(width, 1))), cap)


def k_chunk(rows: int, depth: int) -> int:
    """The reduction length of one program: all of K, or SPLIT_K_CHUNK where K is longer than M and than
    a chunk (a short output over a long reduction: split, or too few programs would run)."""
    return SPLIT_K_CHUNK if depth > max(rows, SPLIT_K_CHUNK) else depth


def _check(name: str, t, other_dim: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [{other_dim}], got shape {tuple(t.shape)}")
    if t.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: expected dtype float32 or bfloat16, got {t.dtype}")


def router_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float32 at float32 accuracy (module docstring): a [M, K], b [K, N], each float32 or
    bfloat16 with any strides, on one device -> C [M, N] float32, contiguous."""
    _check("a", a, "M, K")
    _check("b", b, "K, N")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b: expected {a.shape[1]} rows (a's columns, K), got shape {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"b: expected a tensor on a's device {a.device}, got {b.device}")
    (M, K), N = a.shape, b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros(M, N, dtype=torch.float32, device=a.device)
    chunk = k_chunk(M, K)
    splits = triton.cdiv(K, chunk)
    c = torch.empty(splits, M, N, dtype=torch.float32, device=a.device)
    width = block_n(N)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, width), splits)  # noqa: E731
    router_gemm_kernel[grid](a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), c, c.stride(0), c.stride(1),
                             M, N, K, chunk, BLOCK_N=width)
    return c[0] if splits == 1 else c.sum(0)
