"""Every subcommand reports bad input the same way: one line `shardmoe COMMAND: ...` naming the
option, the expected and the actual value, exit code 2, before any work (simulate and trace
printed tracebacks with exit 1; check --device cuda without CUDA ran the whole matrix and reported
53 of 54 checks failed)."""
import pytest
import torch

from shardmoe import cli

CASES = [
    (["simulate", "--gpus", "0"], "--gpus: expected positive integers, got '0'"),
    (["simulate", "--gpus", "-8"], "--gpus: expected positive integers"),
    (["simulate", "--gpus", "abc"], "--gpus: expected comma-separated integers, got 'abc'"),
    (["simulate", "--gpus", ""], "--gpus: expected positive integers, got ''"),
    (["simulate", "--gpus", "6"], "--gpus 6: the expert-parallel group"),
    (["simulate", "--routing", "zipf:nan"], "--routing: the zipf exponent must be a finite number >= 0, got 'nan'"),
    (["simulate", "--routing", "poisson"], "--routing: expected uniform, zipf:EXPONENT or replay:METRICS_JSONL"),
    (["simulate", "--set", "peak_flops=nan"], "--set: peak_flops expected a positive finite number, got 'nan'"),
    (["simulate", "--set", "top_k"], "--set: expected name=value, got 'top_k'"),
    (["simulate", "--out", "/dev/null/x"], "--out: expected a directory that exists or can be made"),
    (["trace", "--out", "/dev/null/x"], "--out: expected a directory that exists or can be made"),
    (["trace", "--out", "OUT", "--top-k", "9"], "top_k: expected an int in 1..8"),
    (["trace", "--out", "OUT", "--experts", "0"], "num_experts: expected an int"),
    (["trace", "--out", "OUT", "--peers", "0"], "--peers: expected a number >= 1, got 0"),
    (["trace", "--out", "OUT", "--processors", "-1"], "--processors: expected a number >= 1, got -1"),
    (["trace", "--out", "OUT", "--block-m", "0"], "--block-m: expected a number >= 1, got 0"),
    (["trace", "--out", "OUT", "--ranks-per-node", "0"], "--ranks-per-node: expected a number >= 1, got 0"),
    (["trace", "--out", "OUT", "--capacity-factor", "nan"], "capacity_factor: expected None or a positive finite"),
    (["check", "--device", "nosuchdevice"], "--device: expected a torch device"),
    (["bench", "--budget", "nan"], "--budget a finite number > 0"),
    (["bench", "--top-k", "0"], "--top-k: expected a number >= 1, got 0"),
    (["bench", "--experts", "0"], "--experts: expected a number >= 1, got 0"),
    (["bench", "--hf", "mixtral", "--tokens", "-5"], "--tokens: expected a number >= 1, got -5"),
    (["bench", "--json", "/nonexistent/dir/x.json"], "--json: expected a file in an existing directory"),
    (["bench", "--mesh", "d=3"], "--mesh d=3: expected a mesh of the world size 1, got 3 rank(s): launch with torchrun"),
    (["train", "--resume", "--overwrite"], "--resume and --overwrite: expected at most one"),
    # seeds beyond 64 bits: torch would raise an OverflowError
    (["trace", "--out", "OUT", "--seed", str(2 ** 64)], "--seed: expected an int in 0..18446744073709551615, got"),
    (["simulate", "--seed", "-1"], "--seed: expected an int in 0..18446744073709551615, got -1"),
    (["train", "--seed", str(2 ** 64)], "seed: expected an int in 0..18446744073709551615, got 18446744073709551616"),
    (["train", "--timeout-minutes", "1e300"], "timeout_minutes: expected minutes from 1 ms"),
    (["sample", "--out", "OUT", "--prompt", "x", "--seed", str(2 ** 64)], "--seed: expected an int in 0.."),
    (["sample", "--out", "OUT", "--prompt", "x", "--temperature", "0"], "--temperature: expected a finite number > 0"),
    (["sample", "--out", "OUT", "--prompt", "x"], "--out: OUT holds no run (no config.json, no checkpoint)"),
]
if not torch.cuda.is_available():
    CASES.append((["check", "--device", "cuda"], "--device: expected a device this machine has, got 'cuda'"))


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_naming_the_option_with_exit_code_2(argv, message, tmp_path, capsys):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    threads = torch.get_num_threads()
    try:
        code = cli.main(argv)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardmoe {argv[0]}: "), err
    assert message.replace("OUT", str(tmp_path / "out")) in lines[0], lines[0]


def test_an_unknown_option_gets_the_commands_usage(capsys):
    """`shardmoe train --corpus x` prints train's usage (the top-level one lists no option of `train`)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--corpus", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: shardmoe train [-h]") and "--data PATH" in err
    assert err.endswith("shardmoe train: error: unrecognized arguments: --corpus x\n")


def test_train_help_points_at_the_table_of_settings(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert 'docs/training.md, "Configuration"' in " ".join(capsys.readouterr().out.split())
