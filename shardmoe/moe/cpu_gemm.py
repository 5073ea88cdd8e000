"""The per-expert GEMMs on CPU side by side: one expert per intra-op thread (csrc/experts_mm.cpp).

  experts_mm           out[rows of e] = rows[rows of e] @ W_e    rows [N, K], W [E, K, O] -> [N, O]
  experts_weight_grad  dW_e = grad[rows of e]^T @ in[rows of e]  [N, O], [N, K] -> [E, O, K]

Run one after another, each small GEMM splits its rows over every thread and pays their start and
join; side by side, each on one thread, the experts' GEMMs ran 1.04-1.32x faster on 2 threads
(docs/benchmarks.md). Experts holding a thread's share of the rows or more still run one at a time
on all threads, so a skewed routing does not leave the work to one thread. Each GEMM is ATen's
single-thread one; each output is written by one GEMM.

In bf16 every GEMM here runs over a whole number of 32-row blocks or fewer than 32 rows: oneDNN,
which runs torch's bf16 GEMMs on CPU, builds a kernel per shape and keeps only the last 1,024
(~0.65 MiB each), and exact row counts that change every step kept it rebuilding them.
experts_mm splits an expert's rows into the blocks and the rest; experts_weight_grad, whose
reduction runs over the rows (a split would round dW_e twice), pads them to a block instead: the
narrower operand copied with zero rows after its own, the wider read in place over the next
experts' rows where those exist and are finite, copied zero-padded too where not
(docs/benchmarks.md, "Issue 23: bounded bf16 GEMM shapes").

The library is elementwise.py's (one build, one fallback): where it cannot be built, and for what
it does not take (one thread, float64, other devices, tensors under autograd), experts.py keeps its
per-expert loop. SHARDMOE_EXPERTS_MM=0 (shardmoe.settings) keeps the loop too (to compare the two). The GEMMs are torch
operators (torch.ops.shardmoe_gemm: out annotated as written, a Meta kernel) that the wrappers call
directly, so torch.compile(fullgraph=True) traces them, as elementwise.py says for its passes.
"""
from __future__ import annotations

import torch

from shardmoe.moe import elementwise


def available(*tensors: torch.Tensor, passes: elementwise.CpuPasses | None = None) -> bool:
    """Whether the side-by-side GEMMs take these operands: `passes` (the forward's decision:
    SETTINGS.experts_mm on, more than one intra-op thread, the library built; None decides here)
    allows them, and the operands fit (elementwise.operands_fit; any strides)."""
    passes = elementwise.CpuPasses.decide(tensors[0]) if passes is None else passes
    return passes.experts_mm and elementwise.operands_fit(tensors)


def experts_mm(rows: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...], out: torch.Tensor) -> torch.Tensor:
    """out[start_e : start_e + sizes[e]] = rows[same] @ weight[e] for every expert e (rows [N, K],
    weight [E, K, O] in any strides, out [N, O]); returns out."""
    torch.ops.shardmoe_gemm.experts_mm(rows, weight, list(sizes), out)
    return out


def experts_weight_grad(grad_rows: torch.Tensor, in_rows: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """[E, O, K]: grad_rows[rows of e]^T @ in_rows[rows of e], zeros for an expert without rows."""
    out = grad_rows.new_empty((len(sizes), grad_rows.shape[1], in_rows.shape[1]))
    torch.ops.shardmoe_gemm.experts_weight_grad(grad_rows, in_rows, list(sizes), out)
    return out
