"""Helpers for the transformers interop tests: small random models of each family, float64.

Nothing here or in the test modules imports shardmoe.hf at collection: it imports
transformers.integrations, which imports triton, and triton.jit must first see the
TRITON_INTERPRET that tests/kernels/conftest.py sets when it is collected."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def randomize(model: torch.nn.Module, scale: float = 0.3, seed: int = 0) -> None:
    """Redraw every parameter and float buffer of a model (router weights, biases, DeepSeek-V3's
    correction bias included) so that routing is decided by real margins, not by init's tiny
    router weights; norms stay near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
            t.copy_(1 + 0.1 * noise if "norm" in name else scale * noise)


def small_model(family: str, implementation: str = "eager", dtype=torch.float64, seed: int = 0, **sizes):
    from transformers import AutoModelForCausalLM

    from shardmoe.hf.families import small_config

    model = AutoModelForCausalLM.from_config(small_config(family, **sizes), experts_implementation=implementation,
                                             dtype=dtype)
    randomize(model, seed=seed)
    return model


def loss_and_grads(model, ids: torch.Tensor):
    """(logits, loss, {parameter name: grad}) of one forward/backward with labels = ids."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.fixture
def hf():
    """The helpers above, for the test modules (conftest is not importable by name)."""
    import types

    import shardmoe.hf  # noqa: F401  (registers the "shardmoe" experts implementation)

    return types.SimpleNamespace(small_model=small_model, loss_and_grads=loss_and_grads,
                                 relative_error=relative_error, randomize=randomize, convert=shardmoe.hf.convert)
