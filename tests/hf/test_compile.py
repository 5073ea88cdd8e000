"""torch.compile(fullgraph=True) of a transformers causal LM whose experts run through the
"shardmoe" implementation: one graph, and the loss and every gradient equal eager's."""
import pytest
import torch


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_compiled_model_with_the_seam_equals_eager(family, hf):
    model = hf.small_model(family, dtype=torch.float32)
    model.set_experts_implementation("shardmoe")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    _, expected_loss, expected = hf.loss_and_grads(model, ids)

    torch._dynamo.reset()
    compiled = torch.compile(lambda t: model(input_ids=t, labels=t).loss, fullgraph=True, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    loss = compiled(ids)
    loss.backward()
    assert abs(loss.item() - expected_loss.item()) <= 1e-6 * abs(expected_loss.item())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert hf.relative_error(p.grad, expected[name]) < 1e-5, name
