"""Runs tests of a transformers test checkout with shardmoe's experts seam as the default experts
implementation: every model whose config asks for none gets "shardmoe" instead of transformers'
default (grouped_mm, or eager where grouped_mm cannot dispatch). Fetches nothing.

  python benchmarks/hf_model_tests.py CHECKOUT [--default] [--family F ...] [-k EXPR] [PYTEST_ARGS ...]

CHECKOUT is a directory holding transformers' conftest.py and tests/ for the installed transformers
(tests/models/<family>/test_modeling_<family>.py, tests/generation/test_utils.py, ...); their imports
need parameterized, httpx and pytest-xdist. --family (default: shardmoe.hf.families' families) picks
the model test files, -k the tests (default: test_generate_compile_model_forward_fullgraph); each
file runs in its own pytest process with -x. --default runs transformers' own default instead, for
comparison. Each run's summary says which implementation each model resolved to and how many
experts modules ran through the seam; the last lines give each family's outcomes.

This file is also the pytest plugin those processes load (-p hf_model_tests).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

SEAM = os.environ.get("HF_MODEL_TESTS_SEAM", "1") != "0"
STATS = collections.Counter()


def pytest_configure(config):
    import shardmoe.hf
    from shardmoe.hf import experts
    from transformers.modeling_utils import PreTrainedModel

    resolve, owner_init = PreTrainedModel.get_correct_experts_implementation, experts.SeamOwner.__init__

    def get_correct_experts_implementation(model, requested):
        resolved = resolve(model, shardmoe.hf.IMPLEMENTATION if requested is None and SEAM else requested)
        STATS[f"{type(model).__name__}: {resolved}"] += 1
        return resolved

    def counting_init(owner, module, layout):
        STATS[f"experts modules through the seam ({type(module).__name__})"] += 1
        owner_init(owner, module, layout)

    PreTrainedModel.get_correct_experts_implementation = get_correct_experts_implementation
    experts.SeamOwner.__init__ = counting_init


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":  # a skip or an error is reported at setup
        reason = f" ({report.longrepr[2]})" if report.skipped and isinstance(report.longrepr, tuple) else ""
        with open(os.environ["HF_MODEL_TESTS_OUT"], "a") as f:
            f.write(json.dumps(f"{report.nodeid.split('::', 1)[-1]}: {report.outcome}{reason}") + "\n")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_sep("=", "shardmoe seam as the default" if SEAM else "transformers' default")
    for key, count in sorted(STATS.items()):
        terminalreporter.write_line(f"{key}: {count}")


def main(argv=None) -> int:
    import tempfile

    from shardmoe.hf.families import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout")
    parser.add_argument("--default", action="store_true", help="transformers' default experts implementation")
    parser.add_argument("--family", nargs="+", default=list(FAMILIES))
    parser.add_argument("-k", default="test_generate_compile_model_forward_fullgraph")
    args, extra = parser.parse_known_args(argv)
    checkout = os.path.abspath(args.checkout)
    paths = [os.path.dirname(os.path.abspath(__file__)), checkout, os.environ.get("PYTHONPATH", "")]
    results, failed = {}, False
    for family in args.family:
        path = f"tests/models/{family}/test_modeling_{family}.py"
        if not os.path.exists(os.path.join(checkout, path)):
            results[family] = "no test file"
            continue
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
            env = dict(os.environ, HF_MODEL_TESTS_SEAM="0" if args.default else "1", HF_MODEL_TESTS_OUT=out.name,
                       PYTHONPATH=os.pathsep.join(p for p in paths if p))
            code = subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "hf_model_tests",
                                    path, "-k", args.k, "-x", "-rA", *extra], cwd=checkout, env=env)
            results[family] = "; ".join(json.loads(line) for line in out) or f"nothing run (pytest exit {code})"
        failed = failed or code not in (0, 5)
    print("\n".join(f"{family}: {result}" for family, result in results.items()))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
