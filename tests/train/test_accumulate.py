"""Gradient accumulation: grad_accum_steps = N gives the update of the whole batch in one piece.

float64, the DeepSeek-like router (aux, z and sequence-wise losses, correction bias): with
balance_over = "global" every step's losses, loads and weights equal the N = 1 run's to round-off;
with "microbatch" the cross-entropy part is still exact (the balance losses are then the
micro-batches' mean, a different objective, which is checked against its own definition).
A capacity is per forward, so with capacity_factor set the parts drop other pairs than the whole
batch: not equal, by definition, and not tested as such."""

import pytest
import torch

from shardmoe.model.transformer import Transformer
from shardmoe.train.accumulate import accumulate_step, micro_batches
from shardmoe.train.config import TrainConfig
from shardmoe.train.loop import build_streams, train

from .conftest import TINY_MODEL, tiny_train_config, with_moe

ROUTER_MODEL = with_moe(TINY_MODEL, score_func="sigmoid", correction_bias=True, bias_update_rate=0.01,
                        seq_aux_loss_coef=0.05, aux_loss_coef=0.05, z_loss_coef=0.01)
# no capacity_factor: a capacity is per forward (ceil(S / E * factor * k) of that forward's S tokens),
# so micro-batches drop other pairs than the whole batch would; docs/training.md


def _run(**changes):
    config = tiny_train_config(model=ROUTER_MODEL, dtype="float64", steps=3, batch_size=8, eval_batches=0,
                               health_every=0, **changes)
    return train(config, None, progress=False)


def _close(a, b, tol=1e-10):
    return abs(a - b) <= tol * max(abs(b), 1e-30)


@pytest.mark.parametrize("count", [2, 4])
def test_global_balance_equals_the_whole_batch(count, one_thread):
    whole = _run()
    parts = _run(grad_accum_steps=count, balance_over="global")
    for a, b in zip(parts.metrics, whole.metrics):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert _close(a[key], b[key]), (key, a[key], b[key])
        assert a["expert_tokens"] == b["expert_tokens"] and a["dropped_tokens"] == b["dropped_tokens"]
    for (name, p), q in zip(parts.model.named_parameters(), whole.model.parameters()):
        assert (p - q).abs().max() <= 1e-10 * q.abs().max(), name
    for a, b in zip(parts.model.moe_layers(), whole.model.moe_layers()):
        assert torch.equal(a.correction_bias, b.correction_bias)  # from the summed loads


def test_microbatch_balance_is_the_mean_of_the_micro_batches_losses(one_thread):
    config = tiny_train_config(model=ROUTER_MODEL, dtype="float64", batch_size=8)
    data, _ = build_streams(config)
    batch = next(data)
    model = Transformer(ROUTER_MODEL, dtype=torch.float64)
    got = accumulate_step(model, batch, 2, "microbatch", 1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # the layers are left as a plain forward expects them
    assert all(layer.aux_loss_scale == 1.0 and layer.balance_scope is None for layer in model.moe_layers())
    # the definition: sum over parts of (ce summed over the part / all tokens + aux of the part / 2)
    model.zero_grad()
    want_ce = want_aux = 0.0
    for part in micro_batches(batch, 2):
        for layer in model.moe_layers():
            layer.aux_loss_scale = None  # the aux losses as graph nodes, for the reference objective
        losses = model(part.ids, part.is_seq_start, part.targets, batch.targets.numel())
        aux = sum(layer.aux_loss for layer in model.moe_layers())
        (losses.ce + aux / 2).backward()
        want_ce, want_aux = want_ce + losses.ce.item(), want_aux + aux.item() / 2
    assert _close(got.ce, want_ce) and _close(got.aux, want_aux)
    for name, p in model.named_parameters():
        assert (grads[name] - p.grad).abs().max() <= 1e-10 * p.grad.abs().max(), name


def test_microbatch_cross_entropy_is_exact_without_balance_losses(one_thread):
    plain = with_moe(TINY_MODEL, aux_loss_coef=0.0, z_loss_coef=0.0)
    whole = train(tiny_train_config(model=plain, dtype="float64", steps=2, batch_size=8, eval_batches=0), None,
                  progress=False)
    parts = train(tiny_train_config(model=plain, dtype="float64", steps=2, batch_size=8, eval_batches=0,
                                    grad_accum_steps=2), None, progress=False)
    assert all(_close(a["loss"], b["loss"]) for a, b in zip(parts.metrics, whole.metrics))
    for p, q in zip(parts.model.parameters(), whole.model.parameters()):
        assert (p - q).abs().max() <= 1e-10 * q.abs().max()


def test_settings_are_checked():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"grad_accum_steps: expected an int >= 1, got"):
            tiny_train_config(grad_accum_steps=bad)
    with pytest.raises(ValueError, match=r"grad_accum_steps: expected a divisor of batch_size=4, got 3"):
        tiny_train_config(grad_accum_steps=3)
    with pytest.raises(ValueError, match=r"balance_over: expected one of microbatch, global, got 'step'"):
        tiny_train_config(balance_over="step")
    with pytest.raises(ValueError, match=r"dtype: expected one of float32, float64, bfloat16, got 'float16'"):
        tiny_train_config(dtype="float16")
    assert TrainConfig(dtype="bfloat16").param_dtype == torch.float32


def test_bfloat16_trains_float32_masters_under_autocast(tmp_path, one_thread):
    config = tiny_train_config(dtype="bfloat16", steps=6, eval_batches=1)
    run = train(config, tmp_path, stop_after=4, progress=False)
    assert all(p.dtype == torch.float32 for p in run.model.parameters())
    fp32 = train(tiny_train_config(steps=6, eval_batches=1), None, stop_after=4, progress=False)
    for a, b in zip(run.metrics, fp32.metrics):
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * b["loss"]
    resumed = train(config, tmp_path, resume=True, progress=False)
    whole = train(config, None, progress=False)
    assert [r["loss"] for r in resumed.metrics] == [r["loss"] for r in whole.metrics]  # bitwise
