"""The training loop: metrics rows, checkpoints, and resuming with bitwise-identical losses."""
import json

import pytest
import torch
from safetensors import safe_open

from shardmoe.model.transformer import Transformer, TransformerConfig
from shardmoe.train import checkpoint as ckpt
from shardmoe.train.loop import train
from shardmoe.train.metrics import METRICS_FILE
from shardmoe.train.sample import read_samples
from shardmoe.train.presets import ARCH_PRESETS

from .conftest import TINY_MODEL

ROW_KEYS = {"step", "loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "dropped_tokens", "seconds",
            "expert_tokens", "load_max_over_mean", "worst_load_max_over_mean"}
# every column that is a function of the weights and the data (not of the wall clock)
EXACT_KEYS = ("loss", "aux_loss", "lr", "grad_norm", "dropped_tokens", "expert_tokens", "load_max_over_mean",
              "worst_load_max_over_mean")


def read_rows(out_dir):
    return [json.loads(line) for line in (out_dir / METRICS_FILE).read_text().splitlines()]


def test_resumed_run_reproduces_the_uninterrupted_losses_bitwise(tmp_path, tiny_config, one_thread):
    config = tiny_config(checkpoint_every=2)
    whole = train(config, tmp_path / "whole", progress=False)
    first = train(config, tmp_path / "split", stop_after=3, progress=False)
    with open(tmp_path / "split" / METRICS_FILE, "a") as f:  # a row logged after the checkpoint, then a crash
        f.write(json.dumps({"step": 4, "loss": -1.0}) + "\n")
    second = train(config, tmp_path / "split", resume=True, progress=False)

    assert second.start_step == 3
    losses = [r["loss"] for r in whole.metrics]
    exact = [{k: r[k] for k in EXACT_KEYS} for r in whole.metrics]
    assert [{k: r[k] for k in EXACT_KEYS} for r in first.metrics + second.new_metrics] == exact  # not approximate
    assert [{k: r[k] for k in EXACT_KEYS} for r in read_rows(tmp_path / "split")] == exact  # the stale row is gone
    for a, b in zip(whole.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert losses[-1] < losses[0]


def test_metrics_rows_and_checkpoint_contents(tmp_path, tiny_config, one_thread, capsys):
    config = tiny_config(steps=4, checkpoint_every=2, eval_every=2)
    result = train(config, tmp_path, progress=True)
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(ROW_KEYS <= set(r) for r in rows)
    assert "val_loss" in rows[1] and "val_loss" in rows[-1]
    bar = capsys.readouterr().err  # the held-out loss on the progress bar, from its first evaluation on
    assert f"val={rows[1]['val_loss']:.3f}" in bar and f"val={rows[3]['val_loss']:.3f}" in bar, bar
    assert rows[0]["lr"] == pytest.approx(config.lr / config.warmup_steps)
    assert all(r["dropped_tokens"] == 0 for r in rows)  # dropless routing

    path = ckpt.checkpoint_path(tmp_path)
    assert not path.with_name(path.name + ".tmp").exists()
    with safe_open(str(path), framework="pt") as f:
        names, metadata = set(f.keys()), f.metadata()
        assert torch.equal(f.get_tensor("model.unembedding.weight"), result.model.unembedding.weight.detach())
    params = [n for n, _ in result.model.named_parameters()]
    assert names == ({f"model.{n}" for n in params} | {f"optim.exp_avg.{n}" for n in params}
                     | {f"optim.exp_avg_sq.{n}" for n in params} | {"rng.torch"})
    assert metadata["step"] == "4"
    assert json.loads(metadata["data"])["batch"] == 4  # the next batch to read
    assert json.loads(metadata["data"])["tokenizer_digest"] == "byte"  # what `shardmoe sample` checks
    assert json.loads(metadata["config"])["model"]["d_model"] == config.model.d_model


def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, tiny_config, monkeypatch, one_thread):
    config = tiny_config(steps=2)
    result = train(config, tmp_path, progress=False)

    def crash(tensors, filename, metadata):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, result.model, ckpt.AdamW(result.model.named_parameters(), betas=(0.9, 0.9),
                                                                 eps=1e-8, weight_decay=0.0),
                             99, {}, {}, {}, write=True)
    assert ckpt.check_resumable(ckpt.checkpoint_path(tmp_path), config.resume_identity()) == 2


def test_a_checkpoint_of_another_config_is_refused(tmp_path, tiny_config, one_thread):
    config = tiny_config(steps=1, eval_batches=0)
    train(config, tmp_path, progress=False)
    other = config.replace(model=TransformerConfig.from_dict({**config.model.to_dict(), "d_model": 32}), seq_len=8)
    with pytest.raises(ValueError, match=r"model\.d_model: saved 16, now 32.*seq_len: saved 16, now 8"):
        ckpt.check_resumable(ckpt.checkpoint_path(tmp_path), other.resume_identity())
    # optimizer settings and the schedule's length may change
    assert ckpt.check_resumable(ckpt.checkpoint_path(tmp_path), config.replace(lr=0.5, steps=9).resume_identity()) == 1
    with pytest.raises(ValueError, match="no checkpoint"):
        ckpt.check_resumable(tmp_path / "absent.safetensors", config.resume_identity())


def flip_byte(path, tensor_name):
    """Flip one data byte of `tensor_name` in a safetensors file (its header stays valid)."""
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8:8 + header_len])[tensor_name]["data_offsets"]
    data[8 + header_len + begin] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_data_byte_is_refused_before_any_weight_is_used(tmp_path, tiny_config, one_thread):
    config = tiny_config(steps=1, eval_batches=0)
    train(config, tmp_path, progress=False)
    path = ckpt.checkpoint_path(tmp_path)
    flip_byte(path, "optim.exp_avg.blocks.1.moe.down_proj")

    message = rf"checkpoint {path}: corrupt: tensor 'optim.exp_avg.blocks.1.moe.down_proj' has sha256"
    with pytest.raises(ValueError, match=message):
        ckpt.check_resumable(path, config.resume_identity())
    fresh = train(config.replace(steps=1), None, stop_after=0, progress=False).model
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    optimizer = ckpt.AdamW(fresh.named_parameters(), betas=(0.9, 0.9), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match=message):
        ckpt.load_checkpoint(path, fresh, optimizer)
    assert all(torch.equal(before[n], p) for n, p in fresh.named_parameters())  # nothing was loaded
    with pytest.raises(ValueError, match=message):
        train(config.replace(steps=2), tmp_path, resume=True, progress=False)


def test_buffers_round_trip_through_the_checkpoint(tmp_path, tiny_config, one_thread):
    """State that is not a parameter (a router's selection bias is one) is saved and restored."""
    config = tiny_config(steps=1, eval_batches=0)

    def model_with_bias(values):
        model = Transformer(config.model, seed=config.seed)
        model.blocks[1].moe.register_buffer("selection_bias", torch.tensor(values, dtype=torch.float32))
        return model, ckpt.AdamW(model.named_parameters(), betas=(0.9, 0.9), eps=1e-8, weight_decay=0.0)

    saved, optimizer = model_with_bias([0.25, -0.5, 0.0, 1e-3])
    ckpt.save_checkpoint(tmp_path, saved, optimizer, 1, config.to_dict(), config.resume_identity(), {}, write=True)
    with safe_open(str(ckpt.checkpoint_path(tmp_path)), framework="pt") as f:
        assert "buffer.blocks.1.moe.selection_bias" in set(f.keys())
    loaded, optimizer = model_with_bias([0.0] * 4)
    ckpt.load_checkpoint(ckpt.checkpoint_path(tmp_path), loaded, optimizer)
    assert torch.equal(loaded.blocks[1].moe.selection_bias, saved.blocks[1].moe.selection_bias)

    plain = Transformer(config.model, seed=config.seed)
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    with pytest.raises(ValueError, match=r"buffers \{'blocks\.1\.moe\.selection_bias': \[4\]\} in the file, "
                                         r"the model has \{\}"):
        ckpt.load_checkpoint(ckpt.checkpoint_path(tmp_path), plain, optimizer)
    assert all(torch.equal(before[n], p) for n, p in plain.named_parameters())  # nothing was loaded


ROUTER_MODELS = {
    "router_options": dict(score_func="sigmoid", router_bias=True, correction_bias=True, bias_update_rate=0.01,
                           n_group=2, topk_group=1, renormalize_epsilon=1e-20, routed_scaling_factor=2.5,
                           aux_loss_coef=0.0, seq_aux_loss_coef=0.01),
    "deepseek_preset": ARCH_PRESETS["deepseek"]["model"],  # its experts and shared expert on the tiny dims
}


@pytest.mark.parametrize("name", list(ROUTER_MODELS))
def test_resume_with_correction_bias_in_the_checkpoint_is_bitwise(tmp_path, tiny_config, one_thread, name):
    """A DeepSeek-like router (sigmoid, group-limited, router and correction biases, scaling,
    sequence-wise loss over the packed documents), and the `deepseek` preset's model (a shared
    expert, 16 fine-grained experts, no aux loss): the loop moves each block's correction bias after
    every optimizer step, the checkpoint carries it, and a resumed run reproduces the losses and the
    biases bitwise."""
    model = TransformerConfig.from_dict({**TINY_MODEL.to_dict(), **ROUTER_MODELS[name]})
    config = tiny_config(model=model, checkpoint_every=2)
    whole = train(config, tmp_path / "whole", progress=False)
    first = train(config, tmp_path / "split", stop_after=3, progress=False)
    with safe_open(str(ckpt.checkpoint_path(tmp_path / "split")), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys() if k.endswith("correction_bias")}
    assert sorted(saved) == ["model.blocks.0.moe.correction_bias", "model.blocks.1.moe.correction_bias"]
    assert all(b.dtype == torch.float32 and b.abs().max() > 0 for b in saved.values())  # it moved
    second = train(config, tmp_path / "split", resume=True, progress=False)
    losses = [r["loss"] for r in whole.metrics]
    assert [r["loss"] for r in first.metrics + second.new_metrics] == losses
    for a, b in zip(whole.model.blocks, second.model.blocks):
        assert torch.equal(a.moe.correction_bias, b.moe.correction_bias)
        assert (a.moe.gate_bias is None) == (not model.moe.router_bias)
        assert a.moe.gate_bias is None or torch.equal(a.moe.gate_bias, b.moe.gate_bias)
    for a, b in zip(whole.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("checkpoint_format", ["safetensors", "dcp"])
def test_a_resume_restores_the_generator_the_samples_draw_from(tmp_path, tiny_config, one_thread, checkpoint_format):
    """The samples (every 2 steps here) draw from torch's global generator, which a fresh run seeds
    with config.seed and a checkpoint saves: a run stopped at step 3 and resumed in a generator
    state of anything else samples at steps 4 and 6 what the uninterrupted run samples, and leaves
    the generator where it does, only if the resume restores the saved state (in either format)."""
    config = tiny_config(sample_every=2, sample_tokens=12, checkpoint_format=checkpoint_format)
    whole = train(config, tmp_path / "whole", progress=False)
    after_whole = torch.get_rng_state()
    train(config, tmp_path / "split", stop_after=3, progress=False)
    saved = "checkpoint.dcp" if checkpoint_format == "dcp" else "checkpoint.safetensors"
    assert sorted(p.name for p in (tmp_path / "split").iterdir() if p.name.startswith("checkpoint")) == [saved]
    torch.manual_seed(12345)  # what a new process, or other work in this one, leaves in the generator
    resumed = train(config, tmp_path / "split", resume=True, progress=False)

    assert [r["step"] for r in read_samples(tmp_path / "whole", up_to=6)] == [2, 2, 2, 4, 4, 4, 6, 6, 6]
    assert read_samples(tmp_path / "split", up_to=6) == read_samples(tmp_path / "whole", up_to=6)
    assert resumed.samples == whole.samples and len({r["sample"] for r in whole.samples}) == 3
    assert torch.equal(torch.get_rng_state(), after_whole)  # the continued draws


def test_weights_made_non_finite_by_a_step_stop_the_samples_with_the_divergence(tmp_path, tiny_config, monkeypatch,
                                                                              one_thread):
    """A step whose loss and gradient norm are finite can still leave non-finite weights; the
    samples after it (drawn from NaN probabilities, a RuntimeError deep in torch.multinomial) end
    the run as a divergence instead."""
    from shardmoe.train import loop
    from shardmoe.train.loop import TrainingDiverged

    real_step = loop.AdamW.step

    def poisoning_step(self, lr):  # the last step's update: its loss and norm were finite
        real_step(self, lr)
        if self.step_count == 2:
            with torch.no_grad():
                self.params["unembedding.weight"].fill_(float("nan"))

    monkeypatch.setattr(loop.AdamW, "step", poisoning_step)
    with pytest.raises(TrainingDiverged, match="training diverged at step 2: sample: the model's next-token logits "
                                               "are not finite; lower lr or raise warmup_steps"):
        train(tiny_config(steps=2, eval_batches=0), tmp_path, progress=False)


@pytest.mark.parametrize("accum, balance_over, checkpointing", [(1, "microbatch", "none"), (2, "global", "block")])
def test_a_training_step_reads_nothing_from_the_device(monkeypatch, accum, balance_over, checkpointing):
    """optimizer_step on the meta device, which holds shapes and no data, so any .item(),
    .tolist(), .cpu(), bool(t), a boolean-mask index or a data-sized output raises: the forward and
    backward (micro-batches and the counting pass of global balance, recomputed blocks), the
    gradient sync, the global norm and the clipping, AdamW and the correction biases. The MoE layer
    runs its Triton path's own code (kernels forced, their launches recorded, as
    tests/kernels/test_host_reads.py does for the layer) in place of its meta shape function.
    Everything the step leaves stays there, for the log to read once per interval."""
    pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner

    from shardmoe import settings
    from shardmoe.moe import function
    from shardmoe.train.data import Batch
    from shardmoe.train.loop import optimizer_step
    from shardmoe.train.optim import AdamW

    from .conftest import tiny_train_config, with_moe

    launched = []
    monkeypatch.setattr(Autotuner, "run", lambda self, *args, **kwargs: launched.append(self.fn.__name__))
    meta = torch.device("meta")
    config = tiny_train_config(model=with_moe(TINY_MODEL, correction_bias=True), health_every=0,
                               grad_accum_steps=accum, balance_over=balance_over,
                               activation_checkpointing=checkpointing)
    model = Transformer(config.model, device=meta, activation_checkpointing=checkpointing)
    optimizer = AdamW(model.named_parameters(), betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    starts = torch.zeros(4, 16, dtype=torch.bool)
    starts[:, [0, 9]] = True
    batch = Batch(torch.zeros(4, 16, dtype=torch.int64), torch.zeros(4, 16, dtype=torch.int64), starts).to(meta)
    with torch.library._scoped_library("shardmoe", "IMPL") as lib, settings.override(force_kernels=True):
        lib.impl("moe_forward", function.moe_forward, "Meta")
        lib.impl("moe_backward", function.moe_backward, "Meta")
        record = optimizer_step(model, optimizer, batch, config, 1)
    assert launched.count("weight_grad_kernel") == 2 * TINY_MODEL.n_layers * accum  # every layer's backward ran
    tensors = [record.losses.ce, record.losses.aux, record.grad_norm, record.losses.dropped_tokens,
               *record.losses.tokens_per_expert, *(p.grad for p in model.parameters()), *model.buffers(),
               *optimizer.exp_avg.values(), *optimizer.exp_avg_sq.values()]
    assert {t.device for t in tensors} == {meta} and record.flagged == []
