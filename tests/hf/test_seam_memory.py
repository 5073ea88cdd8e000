"""The transformers seam keeps and pools what shardmoe.MoE does: the same expert tensors saved in
workspace blocks, the same pool after a step (the seam's pool is shared by every experts module of
a model, like a converted model's layers)."""
import torch

from shardmoe.tools.bench.saved_bytes import measure_saved_bytes


def test_seam_saves_and_pools_what_the_layer_does(hf):
    from shardmoe.hf import from_block
    from shardmoe.tools.bench.hf_block import family_block

    # [N, 2F] rows of 4096 x 512 fp32 = 8 MiB: above the pool's 4 MiB floor, so the rows are pooled
    block, config = family_block("mixtral", torch.float32, hidden_size=128, ffn_size=256, num_experts=4, top_k=2)
    config._experts_implementation = "shardmoe"
    layer = from_block(block)
    x = torch.randn(2048, 128, generator=torch.Generator().manual_seed(0))
    weights, index = torch.topk(torch.softmax(x @ layer.gate_weight, -1), 2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)

    seam_x = x.clone().requires_grad_()
    seam_saved, seam_out = measure_saved_bytes(lambda: block.experts(seam_x, index, weights),
                                               list(block.parameters()), [seam_x])
    seam_pool = block.experts._shardmoe_owner.workspace
    layer_x = x.clone().requires_grad_()
    layer_saved, layer_out = measure_saved_bytes(lambda: layer(layer_x), list(layer.parameters()), [layer_x])
    # the test routes in its own fp32 arithmetic, the layer in its own: equal to fp32 round-off
    torch.testing.assert_close(seam_out, layer_out, rtol=1e-5, atol=1e-6)

    pooled = seam_saved.in_pools([seam_pool])
    assert pooled >= 4096 * 512 * 4  # h [N, 2F] lives in a pool block
    assert pooled == layer_saved.in_pools([layer.workspace])
    # beside its pooled rows the seam keeps the given routing; the layer keeps its router's state
    assert seam_saved.total <= layer_saved.total
    seam_out.sum().backward()
    layer_out.sum().backward()
    assert seam_pool.resident_bytes == layer.workspace.resident_bytes > 0


def test_a_copy_of_a_model_runs_after_the_original_is_gone(hf):
    """A deep copy (EMA, AveragedModel) made after a forward gets its own operator owner: the
    original's handle dies with the original."""
    import copy
    import gc

    model = hf.small_model("mixtral", dtype=torch.float32)
    model.set_experts_implementation("shardmoe")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    expected = model(input_ids=ids, labels=ids).loss.detach()
    copied = copy.deepcopy(model)
    del model
    gc.collect()
    torch.testing.assert_close(copied(input_ids=ids, labels=ids).loss.detach(), expected, rtol=0, atol=0)
