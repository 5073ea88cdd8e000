"""`shardmoe check`: the table and the exit code."""
import subprocess
import sys

import pytest

import shardmoe
from shardmoe.check.cases import full_matrix, gradcheck_cases, precision_cases, quick_matrix
from shardmoe.cli import main


def test_quick_check_passes(capsys):
    assert main(["check", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "float64: layer vs float64 reference" in out and "gradcheck" in out
    assert "FAIL" not in out and "all passed" in out
    # the quick float64 matrix, the first 2 precision cases in fp32 and bf16, 1 gradcheck case
    assert f"\n{len(quick_matrix()) + 2 * 2 + 1} checks, all passed" in out and len(quick_matrix()) + 5 == 54


class _OffByOne(shardmoe.MoE):
    """Output off by one part in 1e9: invisible in a loose check, a failure here."""

    def forward(self, x):
        return super().forward(x) * (1 + 1e-9)


def test_a_defect_fails_the_run(monkeypatch, capsys):
    monkeypatch.setattr(shardmoe, "MoE", _OffByOne)
    assert main(["check", "--quick", "--dtype", "float64", "--no-gradcheck", "--failures-only"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED" in out.splitlines()[-1]


def test_full_run_count_is_the_one_docs_checking_md_gives():
    """`shardmoe check` with no options: the float64 matrix, the precision set twice, gradcheck."""
    assert len(full_matrix()) + 2 * len(precision_cases()) + len(gradcheck_cases()) == 643


def test_module_entry_point():
    """`python -m shardmoe check` as the Makefile runs it (float64 quick subset only)."""
    done = subprocess.run([sys.executable, "-m", "shardmoe", "check", "--quick", "--dtype", "float64"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "all passed" in done.stdout


@pytest.mark.parametrize("argv", [["check", "--dtype", "float16"], ["check", "--bogus"]])
def test_bad_arguments_are_rejected(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
