"""Architecture presets: `--arch NAME` and `arch` in a config file, layered under the file and the flags."""
import json

import pytest
import torch.distributed as dist

from shardmoe.cli import main
from shardmoe.train import checkpoint as ckpt
from shardmoe.train import presets
from shardmoe.train.command import add_arguments, resolve_config
from shardmoe.train.config import TrainConfig, load_config
from shardmoe.train.loop import train

from .conftest import tiny_train_config, with_moe

# a second architecture, as the deepseek row will be: training settings and a partial model table
WIDE = {"lr": 0.5, "warmup_steps": 7, "model": {"num_experts": 8, "top_k": 1, "ffn_size": 96}}


@pytest.fixture
def wide_preset(monkeypatch):
    monkeypatch.setitem(presets.ARCH_PRESETS, "wide", WIDE)


def resolve(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve_config(parser.parse_args(list(argv)))[0]


def test_every_preset_resolves_and_mixtral_is_the_default_config():
    for name in presets.ARCH_PRESETS:
        assert TrainConfig.from_dict({"arch": name}).arch == name  # every row names known, valid settings
    # what `shardmoe train` trained before presets existed: the dataclass defaults
    assert resolve("--arch", "mixtral") == resolve() == TrainConfig.from_dict({}) == TrainConfig()
    assert resolve().arch == "mixtral"


def test_a_preset_lies_under_the_config_file_and_the_flags(tmp_path, wide_preset):
    config = resolve("--arch", "wide")
    assert (config.arch, config.lr, config.warmup_steps) == ("wide", 0.5, 7)
    assert (config.model.moe.num_experts, config.model.moe.top_k, config.model.moe.ffn_size) == (8, 1, 96)
    assert config.model.d_model == TrainConfig().model.d_model  # not in the row: the default

    path = tmp_path / "run.toml"
    path.write_text('arch = "wide"\nwarmup_steps = 3\n[model]\nd_model = 64\ntop_k = 2\n')
    from_file = load_config(path)
    assert (from_file.lr, from_file.warmup_steps) == (0.5, 3)  # the file replaces what it names
    assert (from_file.model.moe.num_experts, from_file.model.moe.top_k, from_file.model.d_model) == (8, 2, 64)
    assert resolve("--config", str(path), "--steps", "9").steps == 9  # flags over the file
    # --arch replaces the file's arch; the file's settings still apply over it
    mixed = resolve("--config", str(path), "--arch", "mixtral")
    assert (mixed.arch, mixed.lr, mixed.warmup_steps) == ("mixtral", TrainConfig().lr, 3)
    assert mixed.model.moe.num_experts == 4


def test_an_unknown_arch_is_one_line_listing_the_presets(tmp_path, capsys):
    assert main(["train", "--arch", "gpt5", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        f"shardmoe train: --arch: expected one of the presets {', '.join(presets.ARCH_PRESETS)}, got 'gpt5'\n")
    assert not dist.is_initialized() and not (tmp_path / "run").exists()

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"arch": "gpt5"}))
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"shardmoe train: --config {path}: arch: expected one of the presets "
                                       f"{', '.join(presets.ARCH_PRESETS)}, got 'gpt5'\n")
    listed = ", ".join(presets.ARCH_PRESETS)
    with pytest.raises(ValueError, match=rf"arch: expected one of the presets {listed}, got \['mixtral'\]"):
        TrainConfig(arch=["mixtral"])


def test_a_resume_with_another_arch_is_refused(tmp_path, capsys, wide_preset, one_thread):
    config = tiny_train_config(steps=2, eval_batches=0, sample_tokens=0)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({k: v for k, v in config.to_dict().items() if k != "arch"}))
    out = str(tmp_path / "run")
    assert main(["train", "--config", str(path), "--steps", "1", "--out", out, "--no-progress"]) == 0
    assert json.loads(ckpt.read_metadata(ckpt.checkpoint_path(out))["identity"])["arch"] == "mixtral"
    capsys.readouterr()

    # the row changes only training settings: the arch alone differs, and that is enough
    assert main(["train", "--config", str(path), "--arch", "wide", "--out", out, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other settings (arch: the run has 'mixtral', given 'wide')" in err and err.count("\n") == 1
    assert main(["train", "--config", str(path), "--arch", "mixtral", "--out", out, "--resume", "--no-progress"]) == 0


def test_a_checkpoint_from_before_presets_resumes_as_mixtral(tmp_path, wide_preset, one_thread):
    config = tiny_train_config(steps=1, eval_batches=0)
    result = train(config, tmp_path, progress=False)
    optimizer = ckpt.AdamW(result.model.named_parameters(), betas=(0.9, 0.9), eps=1e-8, weight_decay=0.0)
    old_identity = {k: v for k, v in config.resume_identity().items() if k != "arch"}
    ckpt.save_checkpoint(tmp_path, result.model, optimizer, 1, config.to_dict(), old_identity, {}, write=True)

    assert ckpt.check_resumable(ckpt.checkpoint_path(tmp_path), config.resume_identity()) == 1
    with pytest.raises(ValueError, match="arch: saved 'mixtral', now 'wide'"):
        ckpt.check_resumable(ckpt.checkpoint_path(tmp_path), config.replace(arch="wide").resume_identity())


def test_the_mfu_flops_count_the_deepseek_presets_shared_expert():
    """Per layer and token the shared expert adds its two GEMMs, [M] x [M, 2Fs] and [Fs] x [Fs, M]
    (2 FLOPs per multiply-add), and a gated one its [M] . [M] gate."""
    from shardmoe.train.flops import forward_flops_per_token

    model = TrainConfig.from_dict({"arch": "deepseek"}).model
    M, Fs = model.d_model, model.moe.shared_ffn_size
    without = with_moe(model, shared_ffn_size=0)
    per_layer = 2 * M * (2 * Fs) + 2 * Fs * M
    assert forward_flops_per_token(model, 64) - forward_flops_per_token(without, 64) == model.n_layers * per_layer
    gated = with_moe(model, shared_gate=True)
    assert forward_flops_per_token(gated, 64) - forward_flops_per_token(model, 64) == model.n_layers * 2 * M
