"""The parallel package on one process: a one-rank mesh is the MoE layer."""
import torch

import shardmoe
from shardmoe.parallel import sync_grads


def test_a_one_rank_mesh_is_the_single_process_layer():
    torch.manual_seed(0)
    plain = shardmoe.MoE(8, 6, 4, 2, capacity_factor=1.0, aux_loss_coef=0.1, dtype=torch.float64)
    torch.manual_seed(0)
    meshed = shardmoe.MoE(8, 6, 4, 2, capacity_factor=1.0, aux_loss_coef=0.1, dtype=torch.float64,
                          mesh=shardmoe.Mesh())
    x = torch.randn(9, 8, dtype=torch.float64)
    for layer in (plain, meshed):
        (layer(x).square().sum() + layer.aux_loss).backward()
    sync_grads(meshed, meshed.mesh)
    assert meshed.local_experts == range(4)
    for (name, a), (_, b) in zip(plain.named_parameters(), meshed.named_parameters()):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad), name
    assert torch.equal(plain.stats["tokens_per_expert"], meshed.stats["tokens_per_expert"])


def test_select_rows_moves_whole_words_and_equals_byte_indexing():
    """Row widths that 8, 4, 2 and only 1 divide, and a buffer that starts off a word boundary
    (which falls back to bytes): always data[index]."""
    from shardmoe.parallel.exchange import select_rows
    gen = torch.Generator().manual_seed(0)
    index = torch.randperm(7, generator=gen)
    for width in (1024, 1028, 1026, 1027, 0):
        data = torch.randint(0, 256, (7, width), dtype=torch.uint8, generator=gen)
        assert torch.equal(select_rows(data, index), data[index]), width
    flat = torch.randint(0, 256, (7 * 16 + 1,), dtype=torch.uint8, generator=gen)
    unaligned = flat[1:].view(7, 16)  # 16-byte rows one byte past an 8-byte boundary
    assert torch.equal(select_rows(unaligned, index), unaligned[index])
