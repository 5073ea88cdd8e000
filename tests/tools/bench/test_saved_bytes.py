"""Saved-bytes measurement: activations counted, storages deduplicated, parameters excluded."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardmoe.tools.bench.saved_bytes import measure_saved_bytes


def test_saved_bytes_of_a_linear_by_hand():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    sb, y = measure_saved_bytes(lambda: lin(x), lin.parameters(), (x,))
    # addmm keeps x (3*8 fp32 = 96 B) for the weight gradient; the weight is a parameter
    assert (sb.total, sb.input, sb.without_input) == (96, 96, 0)
    y.sum().backward()


def test_saved_bytes_counts_activations_and_dedupes_storages():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)

    def forward():
        z = lin(x)              # saves x (96 B)
        a = F.silu(z)           # saves z: 3*4 fp32 = 48 B
        return a * a[:, :2].repeat(1, 2)  # saves a (48 B) and a's repeat (48 B)

    sb, y = measure_saved_bytes(forward, lin.parameters(), (x,))
    assert sb.input == 96
    assert sb.total == 96 + 48 + 48 + 48
    y.sum().backward()

    # the same storage saved through several views is counted once, and in full
    x2 = torch.randn(4, 6, requires_grad=True)
    sb2, y2 = measure_saved_bytes(lambda: x2[:, :3] * x2[:, 3:], (), (x2,))
    assert (sb2.tensors, sb2.storages) == (2, 1)
    assert sb2.input == 4 * 6 * 4
    y2.sum().backward()


def test_saved_bytes_excludes_parameters_and_bf16_sizes():
    w = torch.nn.Parameter(torch.randn(5, 7, dtype=torch.bfloat16))
    x = torch.randn(2, 5, dtype=torch.bfloat16, requires_grad=True)
    sb, y = measure_saved_bytes(lambda: x @ w, [w], (x,))
    assert sb.total == 2 * 5 * 2  # x in bf16; w (saved for dx) not counted
    y.float().sum().backward()
