"""`shardmoe train` end to end; bad input, a bad or busy --out stopping with one line before any training."""
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardmoe
from shardmoe.cli import main
from shardmoe.train import checkpoint as ckpt
from shardmoe.train import loop
from shardmoe.train.optim import learning_rate

from .conftest import generated_documents, tiny_train_config, word_level


def read_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def write_config(tmp_path, **changes):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny_train_config(**changes).to_dict()))
    return str(path)


def test_tiny_run_writes_metrics_curve_checkpoint_and_samples(tmp_path, capsys, one_thread):
    out = tmp_path / "run"
    assert main(["train", "--config", write_config(tmp_path), "--steps", "3", "--seed", "2",
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and all("loss" in r for r in rows)
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "expert load, max/mean over the experts of the worst layer: step 1" in printed
    assert (out / "checkpoint.safetensors").is_file()
    header, *samples = printed.split("samples at step 3 ")[1].splitlines()
    held_out = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert len(samples) == 3 and samples[0].startswith(f"  {held_out['prompt']} | ")  # a held-out document's start
    assert "tokens/s" in printed and "MFU" in printed
    assert json.loads((out / "config.json").read_text())["seed"] == 2  # the resolved settings, flags included

    assert main(["train", "--config", write_config(tmp_path), "--steps", "3", "--seed", "2", "--out", str(out),
                 "--resume", "--no-progress"]) == 0
    assert "nothing to train" in capsys.readouterr().out


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_training_on_your_own_text_and_jsonl(tmp_path, capsys, monkeypatch, one_thread, bpe_tokenizer, tokenizer):
    """The default model for a few steps on a generated corpus of a text file and a JSONL file, with
    the byte tokenizer and with a BPE tokenizer trained offline (tokenizers): the loss falls, the
    model's vocabulary follows the tokenizer, `shardmoe sample` prints text, and a run stopped at
    step 4 continues with `--resume` alone to its own 8 steps (the default is 600) on its own
    schedule. The config file names the data relative to its own folder."""
    corpus = tmp_path / "project" / "corpus"
    corpus.mkdir(parents=True)
    documents = generated_documents(400)
    (corpus / "part1.txt").write_text("\n\n".join(documents[:200]) + "\n")
    (corpus / "part2.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[200:]))
    settings = tmp_path / "project" / "settings.toml"
    settings.write_text('data = "corpus"\nsteps = 8\nwarmup_steps = 2\nlr = 0.01\nsample_tokens = 24\n')
    monkeypatch.chdir(tmp_path)  # not the file's folder
    spec = "byte" if tokenizer == "byte" else bpe_tokenizer(300)
    out = tmp_path / "run"
    with monkeypatch.context() as m:  # stopped after step 4, as a kill would stop it
        m.setattr(loop, "train", functools.partial(loop.train, stop_after=4))
        assert main(["train", "--config", str(settings), "--tokenizer", spec, "--out", str(out), "--no-progress"]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert (stored["data"], stored["tokenizer"], stored["steps"]) == (str(corpus), spec, 8)
    assert stored["model"]["vocab_size"] == 320  # 257 or 301 ids, padded to a multiple of 64
    capsys.readouterr()

    from shardmoe.train import plots

    units, real_plot = [], plots.plot_loss_curve
    monkeypatch.setattr(plots, "plot_loss_curve", lambda *a, unit, **k: units.append(unit) or real_plot(*a, unit=unit,
                                                                                                        **k))
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"resuming {out} from {out / 'checkpoint.safetensors'} at step 4 of 8\n" in printed
    rows = read_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["lr"] == learning_rate(8, 0.01, 2, 8, 0.1)  # the end of its own schedule
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, [r["loss"] for r in rows]
    # the losses' unit is the tokenizer's (the plot said nats / byte under BPE), and the summary's
    # figure is the mean of this run's last steps, said as such (it was the last step's alone)
    unit = "byte" if tokenizer == "byte" else "token"
    assert units == [unit]
    mean = sum(r["loss"] for r in rows[4:]) / 4
    assert (f"steps 5..8: loss (nats / {unit}) {rows[4]['loss']:.3f} at step 5, mean {mean:.3f} over steps 5..8 "
            f"(last step {rows[-1]['loss']:.3f}); held-out {rows[-1]['val_loss']:.3f};") in printed, printed
    assert "samples at step 8" in printed

    def sampled(*options):
        assert main(["sample", "--out", str(out), "--prompt", "The quiet river", "--max-tokens", "24", *options]) == 0
        return capsys.readouterr().out.split("\n\n", 1)[1]

    text = sampled("--seed", "1")
    assert text.startswith("The quiet river") and len(text) > len("The quiet river") + 10
    assert sampled("--seed", "1") == text  # its own seeded generator
    assert sampled("--top-k", "1", "--seed", "1") == sampled("--top-k", "1", "--seed", "2")  # greedy


@pytest.mark.parametrize("changes, mesh, message", [
    ({}, "t=4", "n_kv_heads: expected a multiple of 4"),
    ({}, "e=3", "num_experts: expected a multiple of 3"),
    ({"model": {"vocab_size": 257}}, "t=2", "vocab_size: expected a multiple of 2"),
    ({"data": "/nonexistent/corpus.txt"}, "", "data: no such file or directory '/nonexistent/corpus.txt'"),
    ({"data": "/dev/null"}, "", "data: expected a file, a directory or a glob pattern, got '/dev/null' (a device or"),
    ({"data": "TMP/empty"}, "", "data: the directory 'TMP/empty' holds no files"),
    ({"data": "TMP/blank.txt"}, "", "data: no documents in 'TMP/blank.txt' (every file is empty or whitespace)"),
    ({"data": "TMP/*.csv"}, "", "data: no files match 'TMP/*.csv'"),
    ({"data": "TMP/small.txt"}, "", "data: the training documents are too small for batch_size=4, seq_len=16: the "
                                    "documents hold 2 tokens, fewer than one batch of 4 rows of 16 tokens; lower "
                                    "batch_size or seq_len"),
    ({"tokenizer": "/nonexistent/tokenizer.json"}, "", "tokenizer: no such file or directory '/nonexistent/tokenizer"),
    ({"tokenizer": "TMP/blank.txt"}, "", "tokenizer: cannot read 'TMP/blank.txt' as a Hugging Face tokenizer.json"),
    ({"tokenizer": "TMP"}, "", "tokenizer: cannot read the directory 'TMP' with transformers' AutoTokenizer"),
    ({"tokenizer": "BPE400"}, "", "model.vocab_size: expected at least the tokenizer BPE400's 401 ids"),
    # numbers the code downstream cannot take: an OverflowError traceback on every rank
    ({"seed": 2 ** 64}, "", "seed: expected an int in 0..18446744073709551615, got 18446744073709551616"),
    ({"timeout_minutes": 1e300}, "", "timeout_minutes: expected minutes from 1 ms (1.67e-05) to 1e+08"),
    ({"timeout_minutes": 1e-6}, "", "timeout_minutes: expected minutes from 1 ms"),
    ({"steps": 2 ** 63}, "", "steps: expected an int in 1..9223372036854775807, got 9223372036854775808"),
    ({"lr": 1e300}, "", "lr: expected a finite number in (0.0, 3.4028234663852886e+38], got 1e+300"),
    ({"model": {"aux_loss_coef": 10 ** 400}}, "", "aux_loss_coef: expected a finite number >= 0, got 1000"),
    ({"model": {"n_layers": 2 ** 40}}, "", "model: expected a model that fits in this machine's"),
    ({"batch_size": 6}, "d=4", "batch_size: expected a multiple of d*e = 4"),
    ({"batch_size": 8, "grad_accum_steps": 4}, "d=4", "grad_accum_steps: expected a divisor of the 2 rows per rank"),
    ({"grad_accum_steps": 0}, "", "grad_accum_steps: expected an int >= 1, got 0"),
    ({"dtype": "float16"}, "", "dtype: expected one of float32, float64, bfloat16, got 'float16'"),
    ({}, "d=2,e=2", "needs 4 rank(s), but the world size is 1"),
    ({"grad_accum_steps": 2}, "p=2,e=2", "--mesh p=2,d=1,e=2,t=1 needs 4 rank(s), but the world size is 1"),
    ({}, "p=2", "grad_accum_steps: expected at least p = 2 micro-batches for 1f1b (its warm-up fills every stage)"),
    ({"grad_accum_steps": 2, "pipeline_schedule": "interleaved-1f1b", "stages_per_rank": 2}, "p=2",
     "model.n_layers: expected at least one block per pipeline stage, 4 stages (p x stages_per_rank), got 2 blocks"),
    ({"grad_accum_steps": 5, "batch_size": 10, "pipeline_schedule": "interleaved-1f1b", "stages_per_rank": 2,
      "model": {"n_layers": 4}}, "p=2", "grad_accum_steps: expected a multiple of max(1, grad_accum_steps // p) = "
                                        "2 for interleaved-1f1b on p = 2, got 5"),
    ({"pipeline_schedule": "zbv"}, "", "pipeline_schedule: expected one of gpipe, 1f1b, interleaved-1f1b, got 'zbv'"),
    ({"pipeline_schedule": "interleaved-1f1b"}, "", "stages_per_rank: expected at least 2 for interleaved-1f1b"),
    ({"stages_per_rank": 2}, "", "stages_per_rank: expected 1 for 1f1b (one stage per rank"),
    ({}, "x=2", "--mesh: expected"),
    ({}, "d=2,d=1", "--mesh: expected each axis at most once, got axis 'd' twice"),
    ({"model": {"vocab_size": 100}}, "", "model.vocab_size: expected at least the byte tokenizer's 257 ids"),
    # unchecked, these crash after the run has begun (step 1; an out-of-memory traceback)
    ({"val_fraction": 0.999}, "", "val_fraction: expected a fraction that leaves documents to train on"),
    ({"model": {"vocab_size": 10 ** 12}}, "", "model: expected a model that fits in this machine's"),
    # silent wrongs: an id past the model's vocabulary, a token read as BOS, every document a lone BOS
    ({"tokenizer": "TMP/sparse.json"}, "", "tokenizer: 'TMP/sparse.json': expected the ids 0..4 of its 5 tokens, got "
                                           "id 5 ('c') past them"),
    ({"tokenizer": "TMP/config-only"}, "", "tokenizer: 'TMP/config-only': expected a vocabulary, got 1 special "
                                           "token(s) and no other"),
    # tracebacks: a TypeError (tokenizers), a UnicodeEncodeError naming neither file nor line (bytes)
    ({"data": "TMP/surrogate.jsonl"}, "", "data: TMP/surrogate.jsonl line 2: expected a 'text' string of Unicode "
                                          "text, got the lone surrogate '\\ud800' at character 0"),
    ({"data": "TMP/surrogate.jsonl", "tokenizer": "BPE400", "model": {"vocab_size": 448}}, "",
     "data: TMP/surrogate.jsonl line 2: expected a 'text' string of Unicode text, got the lone surrogate"),
])
def test_bad_input_stops_with_one_message_before_any_process_group(tmp_path, capsys, changes, mesh, message,
                                                                    bpe_tokenizer):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.txt").write_text("\n  \n\t\n")
    (tmp_path / "small.txt").write_text("a\n\nb\n")
    word_level(tmp_path / "sparse.json", {"a": 0, "b": 1, "[UNK]": 2, "d": 3, "c": 5})
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "\\ud800"}\n')
    placeholders = {"TMP": str(tmp_path), "BPE400": bpe_tokenizer(400)}

    def filled(value):
        for name, path in placeholders.items():
            value = value.replace(name, path) if isinstance(value, str) else value
        return value

    config = tiny_train_config().to_dict()
    for key, value in changes.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else filled(value)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    assert main(["train", "--config", str(path), "--mesh", mesh, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    message = filled(message)
    err = capsys.readouterr().err
    assert err.startswith("shardmoe train: ") and message in err and err.count("\n") == 1
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()


def test_resume_refuses_a_checkpoint_of_another_config(tmp_path, capsys, one_thread):
    out = str(tmp_path / "run")
    assert main(["train", "--config", write_config(tmp_path, sample_tokens=0), "--steps", "1", "--out", out,
                 "--no-progress"]) == 0
    capsys.readouterr()
    other = tiny_train_config(sample_tokens=0).to_dict()
    other["model"]["n_layers"] = 3
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    assert main(["train", "--config", str(path), "--out", out, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other settings (model.n_layers: the run has 2, given 3)" in err and err.count("\n") == 1
    # what the checkpoint was written with counts too (a run directory without config.json)
    (tmp_path / "run" / "config.json").unlink()
    assert main(["train", "--config", str(path), "--out", out, "--resume"]) == 2
    assert "other settings (model.n_layers: the run has 2, given 3)" in capsys.readouterr().err


def test_a_new_run_refuses_a_directory_holding_a_run_unless_resumed_or_overwritten(tmp_path, capsys, one_thread):
    out = tmp_path / "run"
    first = ["train", "--config", write_config(tmp_path, sample_tokens=0), "--steps", "2", "--out", str(out),
             "--no-progress"]
    assert main(first) == 0
    old_rows = (out / "metrics.jsonl").read_text()
    capsys.readouterr()

    second = ["train", "--config", write_config(tmp_path, sample_tokens=0, seed=5), "--steps", "1", "--out", str(out),
              "--no-progress"]
    assert main(second) == 2
    assert capsys.readouterr().err == (
        f"shardmoe train: --out {out}: expected an empty directory for a new run, but it holds checkpoint.safetensors, "
        "config.json, expert_load.png, loss_curve.png, metrics.jsonl; pass --resume to continue that run or "
        "--overwrite to replace it\n")
    assert (out / "metrics.jsonl").read_text() == old_rows  # untouched

    assert main(second + ["--resume", "--overwrite"]) == 2
    assert "--resume and --overwrite: expected at most one" in capsys.readouterr().err
    assert main(second + ["--overwrite"]) == 0
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1]
    assert json.loads(ckpt.read_metadata(out / "checkpoint.safetensors")["config"])["seed"] == 5


def test_a_bad_out_path_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    config = write_config(tmp_path)
    assert main(["train", "--config", config, "--out", str(a_file)]) == 2  # before tokenizing (no progress bar)
    assert capsys.readouterr().err == f"shardmoe train: --out {a_file}: expected a directory, got an existing file\n"
    assert main(["train", "--config", config, "--out", str(a_file / "run"), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"shardmoe train: --out {a_file / 'run'}: cannot create the run directory "
                                       "(Not a directory)\n")


def running_past_a_checkpoint(tmp_path, out) -> tuple[subprocess.Popen, list[str]]:
    """(`shardmoe train` into `out` in a process of its own, endless, a checkpoint every step, once
    it has written its first; its argv). The caller ends the process."""
    config = write_config(tmp_path, steps=100_000, checkpoint_every=1, eval_batches=0, sample_tokens=0)
    argv = ["train", "--config", config, "--out", str(out), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(Path(shardmoe.__file__).parents[1])}
    run = subprocess.Popen([sys.executable, "-m", "shardmoe", *argv], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180  # generous: a loaded machine starts python slowly
        while not (out / "checkpoint.safetensors").exists():
            assert run.poll() is None, run.stderr.read().decode()
            assert time.monotonic() < deadline, "the run wrote no checkpoint within 180 s"
            time.sleep(0.05)
    except BaseException:
        run.kill()
        run.wait()
        raise
    return run, argv


def test_a_second_run_is_refused_while_the_first_runs_and_a_killed_run_resumes(tmp_path, capsys, one_thread):
    out = tmp_path / "run"
    first, argv = running_past_a_checkpoint(tmp_path, out)
    try:
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert main(argv + extra) == 2
            assert capsys.readouterr().err == (f"shardmoe train: --out {out}: another run (pid {first.pid}) is writing "
                                               "this directory; wait for it or choose another --out\n")
    finally:
        first.kill()  # SIGKILL: no clean-up runs, the OS drops its lock
        first.wait()
    step = int(ckpt.read_metadata(out / "checkpoint.safetensors")["step"])
    assert main(argv + ["--resume", "--steps", str(step + 1)]) == 0
    rows = read_rows(out)
    assert [r["step"] for r in rows] == list(range(1, step + 2))


def test_a_diverged_run_stops_with_one_line_after_logging_the_interval(tmp_path, capsys, monkeypatch, one_thread):
    """The step's figures are read once per logging interval: the interval's rows are logged, then
    the run stops naming the first step whose gradient norm (or loss) is not finite."""
    from shardmoe.train import loop

    norms = iter([1.0] + [float("inf")] * 5)
    monkeypatch.setattr(loop, "global_grad_norm", lambda grads: torch.tensor(next(norms), dtype=torch.float64))
    out = tmp_path / "run"
    config = write_config(tmp_path, log_every=4, health_every=0)
    assert main(["train", "--config", config, "--out", str(out), "--no-progress"]) == 1
    assert capsys.readouterr().err == ("shardmoe train: rank 0: training diverged at step 2: loss "
                                       f"{read_rows(out)[1]['loss']}, gradient norm inf; lower lr or raise "
                                       "warmup_steps\n")
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3, 4]


def test_a_checkpoint_with_settings_under_their_former_names_resumes(tmp_path, capsys, one_thread):
    """A run directory without config.json whose checkpoint stores `corpus` and `sample_bytes` (and
    no tokenizer) in its settings and identity: --resume reads them as data, sample_tokens, bytes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path / "run"
    loop.train(tiny_train_config(steps=4, sample_tokens=0), out, stop_after=2, progress=False)
    path = ckpt.checkpoint_path(out)
    with safe_open(str(path), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    former = {"data": "corpus", "sample_tokens": "sample_bytes"}
    for key in ("config", "identity"):
        values = json.loads(metadata[key])
        for name in ("tokenizer", "token_cache", "sample_every"):  # settings the former version did not have
            values.pop(name, None)
        metadata[key] = json.dumps({former.get(k, k): v for k, v in values.items()})
    save_file(tensors, str(path), metadata=metadata)
    assert "corpus" in json.loads(ckpt.read_metadata(path)["config"])

    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert f"resuming {out} from {path} at step 2 of 4\n" in capsys.readouterr().out
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3, 4]


# The model table of tiny_train_config(steps=4, sample_tokens=0) as a run's config.json and its
# checkpoints store it, in their order: flat, every MoE option beside the model's dims
FLAT_MODEL = {"vocab_size": 260, "d_model": 16, "n_layers": 2, "n_q_heads": 4, "n_kv_heads": 2, "head_dim": 4,
              "ffn_size": 8, "num_experts": 4, "top_k": 2, "capacity_factor": None, "aux_loss_coef": 0.01,
              "z_loss_coef": 0.001, "score_func": "softmax", "router_bias": False, "correction_bias": False,
              "bias_update_rate": 0.001, "n_group": 1, "topk_group": 1, "renormalize_epsilon": 0.0,
              "routed_scaling_factor": 1.0, "seq_aux_loss_coef": 0.0, "expert_bias": False, "activation": "silu",
              "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "shared_ffn_size": 0, "shared_gate": False,
              "rope_theta": 10000.0, "norm_eps": 1e-05, "init_std": 0.02}
FLAT_IDENTITY = {"arch": "mixtral", "batch_size": 4, "data": None, "dtype": "float32", "model": FLAT_MODEL, "seed": 0,
                 "seq_len": 16, "tokenizer": "byte", "val_fraction": 0.05}


def test_a_run_that_stores_the_model_table_flat_resumes_and_refuses_a_changed_option(tmp_path, capsys, one_thread):
    """A run directory whose config.json and checkpoint hold the model's options flat, as above: the
    model config reads it back equal, its resume identity is the stored one key for key, --resume
    continues the run, and a changed MoE option, given again, is refused by its flat name (by
    config.json, and by the checkpoint without config.json)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardmoe.model.transformer import TransformerConfig

    config = tiny_train_config(steps=4, sample_tokens=0)
    assert config.model.to_dict() == FLAT_MODEL and TransformerConfig.from_dict(FLAT_MODEL) == config.model
    assert config.resume_identity() == FLAT_IDENTITY
    out = tmp_path / "run"
    loop.train(config, out, stop_after=2, progress=False)
    path = ckpt.checkpoint_path(out)
    with safe_open(str(path), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    settings = {**config.to_dict(), "model": FLAT_MODEL}
    metadata.update(config=json.dumps(settings), identity=json.dumps(FLAT_IDENTITY, sort_keys=True))
    save_file(tensors, str(path), metadata=metadata)
    (out / "config.json").write_text(json.dumps(settings, indent=1) + "\n")

    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps({**settings, "model": {**FLAT_MODEL, "expert_bias": True}}))
    assert main(["train", "--config", str(changed), "--out", str(out), "--resume"]) == 2
    assert "other settings (model.expert_bias: the run has False, given True)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"written with another config: model\.num_experts: saved 4, now 8$"):
        other = config.replace(model=TransformerConfig.from_dict({**FLAT_MODEL, "num_experts": 8}))
        ckpt.check_resumable(path, other.resume_identity())
    # a checkpoint written before a model option existed (here seq_aux_loss_coef) resumes at its default only
    older = {**FLAT_IDENTITY, "model": {k: v for k, v in FLAT_MODEL.items() if k != "seq_aux_loss_coef"}}
    older_path = tmp_path / "older.safetensors"
    save_file(tensors, str(older_path), metadata={**metadata, "identity": json.dumps(older, sort_keys=True)})
    assert ckpt.check_resumable(older_path, config.resume_identity()) == 2
    with pytest.raises(ValueError, match=r"another config: model\.seq_aux_loss_coef: saved 0\.0, now 0\.01$"):
        ckpt.check_resumable(older_path, config.replace(
            model=TransformerConfig.from_dict({**FLAT_MODEL, "seq_aux_loss_coef": 0.01})).resume_identity())
    os.replace(out / "config.json", tmp_path / "config.json")
    assert main(["train", "--config", str(changed), "--out", str(out), "--resume"]) == 2
    assert "other settings (model.expert_bias: the run has False, given True)" in capsys.readouterr().err
    os.replace(tmp_path / "config.json", out / "config.json")

    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert f"resuming {out} from {path} at step 2 of 4\n" in capsys.readouterr().out
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3, 4]
    assert json.loads((out / "config.json").read_text())["model"] == FLAT_MODEL


def test_a_resume_may_change_the_pipeline_schedule_as_it_may_change_the_mesh(tmp_path, capsys, one_thread):
    """pipeline_schedule and stages_per_rank are the layout's, like --mesh: a run set up with one
    schedule resumes with another (config.json records it); another setting is still refused."""
    out = tmp_path / "run"
    config = write_config(tmp_path, grad_accum_steps=2, eval_batches=0, sample_tokens=0)
    assert main(["train", "--config", config, "--steps", "2", "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["pipeline_schedule"] == "1f1b"
    assert main(["train", "--out", str(out), "--resume", "--steps", "3", "--pipeline-schedule", "interleaved-1f1b",
                 "--stages-per-rank", "2", "--no-progress"]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert (stored["pipeline_schedule"], stored["stages_per_rank"]) == ("interleaved-1f1b", 2)
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3]
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--seed", "5", "--pipeline-schedule", "gpipe",
                 "--stages-per-rank", "1", "--no-progress"]) == 2
    assert "other settings (seed: the run has 0, given 5)" in capsys.readouterr().err


def test_device_cpu_keeps_every_parameter_moment_and_batch_on_the_cpu(tmp_path, capsys, monkeypatch, one_thread):
    """--device cpu: every step's batch, and after it every parameter, gradient, buffer and AdamW
    moment, live on the chosen device; a GPU asked for on a machine without one is one line, exit
    2, before the run directory exists."""
    from shardmoe.train import loop

    seen, real = [], loop.optimizer_step

    def spy(model, optimizer, batch, *args, **kwargs):
        record = real(model, optimizer, batch, *args, **kwargs)
        tensors = [*batch, *model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
                   *optimizer.exp_avg.values(), *optimizer.exp_avg_sq.values(), record.grad_norm, record.losses.ce]
        seen.append((model.device, {t.device for t in tensors}))
        return record

    monkeypatch.setattr(loop, "optimizer_step", spy)
    out = tmp_path / "run"
    assert main(["train", "--config", write_config(tmp_path), "--steps", "2", "--device", "cpu", "--out", str(out),
                 "--no-progress"]) == 0
    assert seen == [(torch.device("cpu"), {torch.device("cpu")})] * 2
    assert json.loads((out / "config.json").read_text())["device"] == "cpu"
    if torch.cuda.is_available():
        return
    capsys.readouterr()
    assert main(["train", "--config", write_config(tmp_path), "--device", "cuda", "--out", str(tmp_path / "gpu"),
                 "--no-progress"]) == 2
    assert capsys.readouterr().err == ("shardmoe train: device: expected a machine with a GPU torch can use for "
                                       "'cuda' (torch.cuda.is_available() is False); use cpu or auto\n")
    assert not (tmp_path / "gpu").exists()


def test_a_gpu_runs_memory_check_is_against_the_gpus_memory(monkeypatch):
    """mixtral-1gpu needs 21.8 GiB for its fp32 weights, gradients and moments: a GPU run is checked
    against the GPU's memory (torch's view of it monkeypatched), not the host's."""
    import types

    from shardmoe.train.command import check_memory
    from shardmoe.train.config import TrainConfig

    config = TrainConfig.from_dict({"arch": "mixtral-1gpu"})
    sizes = {0: 80 * 2 ** 30, 1: 16 * 2 ** 30}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=sizes[d.index]))
    check_memory(config, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"^model: expected a model that fits in GPU 1's 16.0 GiB, got 1,461,012,480 "
                                         r"parameters needing at least 21.8 GiB for weights, gradients and AdamW's two "
                                         r"moments in torch.float32$"):
        check_memory(config, torch.device("cuda", 1))


def test_a_config_file_given_again_to_resume_compares_only_the_settings_it_sets(tmp_path, capsys, one_thread):
    """A file that sets neither steps nor seed, given again to --resume a run of --steps 2 --seed 3:
    the run is neither extended to the default 600 steps nor refused as seed 0 (their defaults were
    compared); a setting the file does set, at another value than the run's, is refused by name."""
    tiny = tiny_train_config(sample_tokens=0).to_dict()
    settings = {key: tiny[key] for key in ("batch_size", "seq_len", "eval_batches", "checkpoint_every",
                                           "sample_tokens", "health_every")}
    settings["model"] = {key: tiny["model"][key] for key in ("vocab_size", "d_model", "n_layers", "n_q_heads",
                                                             "n_kv_heads", "head_dim", "ffn_size", "num_experts")}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(settings))
    out = tmp_path / "run"
    assert main(["train", "--config", str(path), "--steps", "2", "--seed", "3", "--out", str(out),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert capsys.readouterr().out.endswith(f"nothing to train: {out} is already at step 2 of 2\n")
    assert json.loads((out / "config.json").read_text())["steps"] == 2

    path.write_text(json.dumps({**settings, "lr": 0.5, "model": {**settings["model"], "ffn_size": 16}}))
    assert main(["train", "--config", str(path), "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "other settings (lr: the run has 0.006, given 0.5; model.ffn_size: the run has 8, given 16)" in err, err


def test_a_resume_that_cannot_continue_is_refused_before_the_run_directory_is_touched(tmp_path, capsys, one_thread):
    """A run at step 4: --resume --steps 2 ("at step 4 of 2", exit 0, config.json rewritten to 2
    before), and its data edited since (a ValueError traceback once the directory was claimed and
    config.json rewritten): one line each, exit 2, every file of the run as it was."""
    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(generated_documents(60)) + "\n")
    config = write_config(tmp_path, sample_tokens=0, data=str(data), token_cache=str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["train", "--config", config, "--steps", "4", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    assert main(["train", "--out", str(out), "--resume", "--steps", "2", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"shardmoe train: --steps 2: expected at least the run's 4 steps taken "
                                       f"(checkpoint {out / 'checkpoint.safetensors'}); a resumed run ends at or "
                                       "after its checkpoint\n")
    data.write_text(data.read_text() + "\nOne more document.\n")
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardmoe train: --resume: the run's data or tokenizer changed since checkpoint "
                          f"{out / 'checkpoint.safetensors'} was written (data state: num_documents was ") and \
        err.endswith("; resume on the data it trained on, or start a new run\n") and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == files


def test_a_full_disk_ends_the_run_with_one_line(tmp_path, capsys, monkeypatch, one_thread):
    """A checkpoint write that fails as on a full disk (safetensors raises its own SafetensorError):
    one line naming the file, exit 1, and the previous checkpoint resumes; the token cache's files
    on /dev/full (ENOSPC, an OSError): one line naming the cache, exit 2, no run directory."""
    from safetensors import SafetensorError

    from shardmoe.train import token_cache

    real_save, calls = ckpt.save_file, []

    def second_write_fails(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        real_save(tensors, filename, metadata=metadata)

    out = tmp_path / "run"
    argv = ["train", "--config", write_config(tmp_path, sample_tokens=0, checkpoint_every=1, steps=3), "--out",
            str(out), "--no-progress"]
    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_file", second_write_fails)
        assert main(argv) == 1
    path = out / "checkpoint.safetensors"
    assert capsys.readouterr().err == (f"shardmoe train: rank 0: cannot write the checkpoint {path}.tmp: Error while "
                                       "serializing: I/O error: No space left on device (os error 28); "
                                       f"{path} keeps the previous one\n")
    assert ckpt.read_metadata(path)["step"] == "1"
    assert main(argv + ["--resume"]) == 0
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3]

    real_open = open

    def full_disk(file, mode="r", *args, **kwargs):
        return real_open("/dev/full" if str(file).endswith(".bin") else file, mode, *args, **kwargs)

    monkeypatch.setattr(token_cache, "open", full_disk, raising=False)
    cache = tmp_path / "cache"
    config = write_config(tmp_path, token_cache=str(cache))
    assert main(["train", "--config", config, "--out", str(tmp_path / "run2"), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"shardmoe train: token_cache: cannot write the token cache in '{cache}' (No "
                                       "space left on device)\n")
    assert not (tmp_path / "run2").exists()


def test_ctrl_c_is_one_line_naming_the_last_checkpoint_and_the_command_that_resumes(tmp_path, capsys, one_thread):
    """SIGINT to a running `shardmoe train` (a 20-line KeyboardInterrupt traceback before): one
    line on stderr naming the newest checkpoint and its step and the command that continues the
    run, exit status 130; that command resumes from it (here to its own step: nothing left to train)."""
    out = tmp_path / "run"
    run, _ = running_past_a_checkpoint(tmp_path, out)
    try:
        run.send_signal(signal.SIGINT)
        err = run.communicate(timeout=120)[1].decode()
    finally:
        run.kill()
        run.wait()
    step = int(ckpt.read_metadata(out / "checkpoint.safetensors")["step"])
    assert run.returncode == 130 and err == (
        f"shardmoe train: interrupted; the last checkpoint is {out / 'checkpoint.safetensors'} at step {step}; "
        f"continue with: shardmoe train --out {out} --resume\n"), (run.returncode, err)
    command = err.split("continue with: ")[1].split()
    assert command[:2] == ["shardmoe", "train"]
    assert main(command[1:] + ["--steps", str(step), "--no-progress"]) == 0
    assert capsys.readouterr().out.endswith(f"nothing to train: {out} is already at step {step} of {step}\n")


def test_grad_accum_steps_is_a_flag_over_the_config_file(tmp_path):
    """The pipelined example needs grad_accum_steps >= p without a config file to write."""
    import argparse

    from shardmoe.train.command import add_arguments, resolve_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert resolve_config(parser.parse_args(["--grad-accum-steps", "2"]))[0].grad_accum_steps == 2
    path = write_config(tmp_path, grad_accum_steps=4)
    assert resolve_config(parser.parse_args(["--config", path]))[0].grad_accum_steps == 4
    assert resolve_config(parser.parse_args(["--config", path, "--grad-accum-steps", "2"]))[0].grad_accum_steps == 2


def test_sample_refuses_what_it_cannot_continue_with_one_line(tmp_path, capsys, one_thread, bpe_tokenizer):
    """`shardmoe sample` on a run without a checkpoint yet (it named --resume, an option sample
    lacks); with a prompt of bytes that are not UTF-8 (a TypeError traceback); with the tokenizer at
    the run's path replaced by one of the same size whose ids mean other tokens (text printed, exit
    0) or by a larger one (an IndexError traceback): one line each, exit 2."""
    import dataclasses
    import shutil

    from shardmoe.train.run_settings import write_settings

    from .conftest import TINY_MODEL

    tokenizer = tmp_path / "tokenizer.json"
    shutil.copy(bpe_tokenizer(300), tokenizer)
    config = tiny_train_config(model=dataclasses.replace(TINY_MODEL, vocab_size=320), tokenizer=str(tokenizer),
                               steps=1, sample_tokens=0)
    out = tmp_path / "run"
    out.mkdir()
    write_settings(out, config)
    sample = ["sample", "--out", str(out), "--prompt", "The quiet river", "--max-tokens", "4"]
    assert main(sample) == 2
    assert capsys.readouterr().err == (f"shardmoe sample: --out: no checkpoint at {out / 'checkpoint.safetensors'} "
                                       f"(nor a sharded one in {out / 'checkpoint.dcp'})\n")
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config.to_dict()))
    assert main(["train", "--config", str(path), "--out", str(out), "--overwrite", "--no-progress"]) == 0
    assert main(sample) == 0
    capsys.readouterr()

    assert main(sample[:3] + ["--prompt", "caf\udce9 au lait"]) == 2  # b"caf\xe9 au lait" as argv decodes it
    assert capsys.readouterr().err == ("shardmoe sample: --prompt: expected UTF-8 text, got the byte b'\\xe9' at "
                                       "character 3 of b'caf\\xe9 au lait'\n")
    table = json.loads(tokenizer.read_text())
    vocab = table["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # the same 300 ids; 'a' and 'b' swapped
    tokenizer.write_text(json.dumps(table))
    for replaced in ("swapped", "larger"):
        if replaced == "larger":
            shutil.copy(bpe_tokenizer(400), tokenizer)
        assert main(sample) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"shardmoe sample: --out: the tokenizer {tokenizer} is not the one the run trained with "
                              "(its sha256 was ") and err.count("\n") == 1, (replaced, err)


def test_the_summarys_mfu_is_the_runs_flops_over_its_time_as_its_tokens_per_s_is(tmp_path, capsys, monkeypatch,
                                                                                 one_thread):
    """The summary's tokens/s and MFU describe the same run: its tokens, and its model FLOPs, over its
    whole time. With a first interval of slow steps (a C++ build, say) beside fast ones, the mean of
    the rows' MFUs weighs each step alike and overstated the run's MFU against its tokens/s (here
    38.9% for 30%)."""
    from shardmoe.train.flops import Peak, train_flops_per_token

    config = tiny_train_config(sample_tokens=0)
    tokens_per_step = config.batch_size * config.seq_len
    flops_per_step = train_flops_per_token(config.model, config.seq_len) * tokens_per_step
    monkeypatch.setattr(loop, "peak_flops", lambda device, dtype: Peak(2 * flops_per_step, "a stand-in peak"))
    real_train = loop.train

    def timed(*args, **kwargs):  # steps 1-2 took 3 s each, steps 3-6 1 s each, as the loop would log them
        result = real_train(*args, **kwargs)
        for row in result.metrics:
            row["seconds"] = 3.0 if row["step"] <= 2 else 1.0
            row["tokens_per_s"] = tokens_per_step / row["seconds"]
            row["mfu"] = flops_per_step / row["seconds"] / result.peak_flops
        return result

    monkeypatch.setattr(loop, "train", timed)
    assert main(["train", "--config", write_config(tmp_path, sample_tokens=0), "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    tokens_per_s = 6 * tokens_per_step / (2 * 3.0 + 4 * 1.0)
    assert f"{tokens_per_s:.0f} tokens/s, MFU 30.0% of a stand-in peak" in printed, printed
