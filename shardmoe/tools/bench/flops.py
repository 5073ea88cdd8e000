"""The benchmarked shapes and the GEMM FLOPs of one MoE layer's forward + backward on them.

The report's GFLOP/s of every candidate is total_flops(shape) / its median time.
"""
from __future__ import annotations

from dataclasses import dataclass

# name -> (S, H, F, E, k)
SHAPES = {
    "e8": (4096, 512, 1024, 8, 2),    # Mixtral-like: few wide experts
    "e64": (4096, 512, 128, 64, 2),   # many narrow experts, top-2
    "fine": (4096, 512, 128, 64, 8),  # fine-grained as Qwen3-MoE and DeepSeek-V3: F = H/4, top-8 of 64
}


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int

    def __str__(self) -> str:
        return f"S={self.tokens} H={self.hidden} F={self.ffn} E={self.experts} k={self.top_k}"


def expert_flops(s: Shape) -> int:
    """GEMM FLOPs of the SwiGLU experts, forward + backward, dropless.

    M = S*k dispatched rows. Forward: h = x Wgu^T (2*M*H*2F) and y = a Wd^T (2*M*F*H).
    Backward repeats each GEMM twice (input gradient and weight gradient), so the total
    is 3 x forward = 3 * (2*M*H*2F + 2*M*F*H) = 18*M*H*F."""
    m = s.tokens * s.top_k
    return 3 * (2 * m * s.hidden * 2 * s.ffn + 2 * m * s.ffn * s.hidden)


def router_flops(s: Shape) -> int:
    """GEMM FLOPs of the gate, forward + backward: logits = x Wg (2*S*H*E), then dx and dWg."""
    return 3 * 2 * s.tokens * s.hidden * s.experts


def total_flops(s: Shape) -> int:
    """Every GEMM FLOP of an MoE layer's forward + backward. Elementwise work (softmax,
    top-k, silu, the combine) is not counted: it is O(S*k*(F+H)) against O(S*k*H*F)."""
    return expert_flops(s) + router_flops(s)
