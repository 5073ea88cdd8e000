"""GEMM FLOP counts of a shape, by hand."""
from __future__ import annotations

from shardmoe.tools.bench.flops import Shape, expert_flops, router_flops, total_flops


def test_flop_formulas_by_hand():
    s = Shape(tokens=4, hidden=3, ffn=5, experts=2, top_k=2)
    # M = S*k = 8 rows; forward 2*8*3*10 (gate/up) + 2*8*5*3 (down) = 480 + 240; x3 for fwd+bwd
    assert expert_flops(s) == 3 * (480 + 240) == 2160 == 18 * 8 * 3 * 5
    # logits 2*S*H*E = 48, x3
    assert router_flops(s) == 144
    assert total_flops(s) == 2304
