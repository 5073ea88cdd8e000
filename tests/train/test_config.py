"""TrainConfig: defaults, JSON and TOML files, and errors that name the setting."""
import dataclasses
import json

import pytest

from shardmoe.model.transformer import TransformerConfig
from shardmoe.train.config import TrainConfig, load_config

from .conftest import with_moe


def test_toml_and_json_files_load_with_a_model_table(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 12\nlr = 0.002\n[model]\nd_model = 64\nnum_experts = 8\n')
    config = load_config(toml)
    assert config.steps == 12 and config.lr == 0.002
    default_moe = TransformerConfig().moe
    assert config.model == TransformerConfig(d_model=64, moe=dataclasses.replace(default_moe, hidden_size=64,
                                                                                num_experts=8))
    assert config.batch_size == TrainConfig().batch_size  # untouched settings keep their defaults

    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps(config.to_dict()))
    assert load_config(as_json) == config


@pytest.mark.parametrize("text, message", [
    ('stpes = 3', "unknown setting"),
    ('[model]\nd_modle = 3', "unknown option"),
    ('lr = -1.0', "lr"),
    ('dtype = "float16"', "dtype"),
    ('steps = 0', "steps"),
    ('threads = 100000', r"threads: expected an int in 0\.\.\d+ \(os\.cpu_count\(\)\), got 100000"),
    ('steps = [', "run.toml"),
    ('[model]\nvocab_size = 100', r"model.vocab_size: expected at least the byte tokenizer's 257 ids \(its tokens "
                                   r"and BOS\), got 100"),
    ('timeout_minutes = 0', r"timeout_minutes: expected minutes from 1 ms \(1\.67e-05\) to 1e\+08 \(the most the "
                            r"process group can count\), got 0"),
    # a truthy string switched the expert biases on
    ('[model]\nexpert_bias = "false"', "expert_bias: expected a bool, got 'false'"),
    ('[model]\nrouter_bias = 0', "router_bias: expected a bool, got 0"),
])
def test_bad_files_name_the_setting(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "absent.toml")
    (tmp_path / "run.yaml").write_text("steps: 3")
    with pytest.raises(ValueError, match="json or .toml"):
        load_config(tmp_path / "run.yaml")


def test_resume_identity_covers_what_fixes_weights_and_data():
    base = TrainConfig()
    assert base.replace(lr=1.0, steps=5).resume_identity() == base.resume_identity()
    assert base.replace(seq_len=32).resume_identity() != base.resume_identity()
    assert base.replace(model=TransformerConfig.from_dict({"d_model": 64})).resume_identity() != base.resume_identity()
    assert base.replace(model=with_moe(base.model, shared_ffn_size=8)).resume_identity() != base.resume_identity()


def test_the_settings_table_of_the_docs_lists_every_setting():
    """docs/training.md ("Configuration") has a row for every key a config file takes."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    table = text.split("Every setting (`model.` ones go in the `model` table):")[1].split("\n\n")[1]
    listed = {name for row in table.splitlines()[2:] for name in re.findall(r"`([a-z_.0-9]+)`", row.split(" | ")[0])}
    keys = {f.name for f in dataclasses.fields(TrainConfig) if f.name != "model"}
    keys |= {f"model.{name}" for name in TransformerConfig().to_dict()}
    assert listed == keys, (sorted(keys - listed), sorted(listed - keys))
