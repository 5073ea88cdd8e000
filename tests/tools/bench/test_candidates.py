"""The candidates: the dense anchor does the counted FLOPs; the loop baseline is right."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardmoe.tools.bench.candidates import dense_candidate, loop_moe
from shardmoe.tools.bench.flops import SHAPES, Shape, total_flops


@pytest.mark.parametrize("shape", [Shape(*SHAPES["e8"]), Shape(*SHAPES["e64"]),
                                   Shape(24, 16, 8, 4, 3)])
def test_dense_anchor_does_the_counted_flops(shape):
    small = Shape(min(shape.tokens, 64), shape.hidden, shape.ffn, shape.experts, shape.top_k)
    c = dense_candidate(small, torch.float32, "cpu", preallocated=True, name="dense")
    assert c.flops == total_flops(small)
    c.step()


def test_loop_baseline_matches_a_dense_per_token_oracle():
    torch.manual_seed(0)
    S, H, F_, E, k = 10, 8, 6, 3, 2
    x = torch.randn(S, H, dtype=torch.float64)
    wg, wgu, wd = torch.randn(H, E, dtype=torch.float64), torch.randn(E, 2 * F_, H, dtype=torch.float64), \
        torch.randn(E, H, F_, dtype=torch.float64)
    out = loop_moe(x, wg, wgu, wd, k)
    p = torch.softmax(x @ wg, -1)
    for t in range(S):
        top = torch.topk(p[t], k)
        w = top.values / top.values.sum()
        ref = sum(wj * (wd[e] @ (F.silu(wgu[e, :F_] @ x[t]) * (wgu[e, F_:] @ x[t])))
                  for wj, e in zip(w, top.indices.tolist()))
        torch.testing.assert_close(out[t], ref)
