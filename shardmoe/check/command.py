"""`shardmoe check`: the MoE layer against its float64 references, as a table.

Three parts, each selectable:
  float64    the configuration matrix (cases.full_matrix, or quick_matrix with --quick):
             the layer vs the plain-autograd reference, relative error <= 1e-10
  float32,   the precision set (cases.precision_cases): the layer in that dtype vs the
  bfloat16   float64 reference on the same rounded inputs, <= 1e-5 and <= 2e-2
  gradcheck  central finite differences on small float64 configs (skipped by --no-gradcheck)

Each row shows the worst relative error of every tensor (see compare.py for the
definition): the output y, the aux loss, and the gradients of the input x, the gate
and the expert weights (W_in = gate_up_proj or w1, W_out = down_proj or w2, b_in = b1,
b_out = b2). The exit code is 1 if any check failed, 0 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import time

DTYPE_CHOICES = ("all", "float64", "float32", "bfloat16")
COLUMNS = (
    ("output", ("output",)), ("aux", ("aux_loss",)), ("x", ("x",)), ("gate", ("gate_weight",)),
    ("W_in", ("gate_up_proj", "w1")), ("W_out", ("down_proj", "w2")), ("b_in", ("b1", "gate_up_proj_bias")),
    ("b_out", ("b2", "down_proj_bias")),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a subset touching every option once, one gradcheck, two precision cases")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="all",
                        help="float64 runs the matrix; float32/bfloat16 the precision set (default: all)")
    parser.add_argument("--no-gradcheck", dest="gradcheck", action="store_false",
                        help="skip the finite-difference checks")
    parser.add_argument("--failures-only", action="store_true", help="print only the rows that fail")
    parser.add_argument("--device", default="cpu", help="device the MoE layer runs on (default: cpu)")


def _format_error(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _row(name: str, errors: dict[str, float], passed: bool, width: int) -> str:
    cells = []
    for _, keys in COLUMNS:
        present = [errors[k] for k in keys if k in errors]
        cells.append(_format_error(present[0] if present else None).rjust(8))
    return f"{name.ljust(width)} {' '.join(cells)}  {'pass' if passed else 'FAIL'}"


def _header(width: int) -> str:
    return f"{'config'.ljust(width)} {' '.join(title.rjust(8) for title, _ in COLUMNS)}  result"


def _compare_section(title: str, cases, dtype, args) -> tuple[int, int]:
    """Print one dtype's comparison table; return (checks, failures)."""
    from shardmoe.check.compare import TOLERANCES, compare_with_reference

    print(f"\n{title}: layer vs float64 reference, {len(cases)} configs, "
          f"tolerance {TOLERANCES[dtype]:g} (max|a-b| / max|b| per tensor)")
    width = max(len(c.name) for c in cases)
    print(_header(width))
    failures = 0
    for case in cases:
        try:
            result = compare_with_reference(case, dtype, args.device)
            errors, passed, problems = result.errors, result.passed, result.problems
        except Exception as err:  # a crash in one config is a failure of that config, not of the run
            errors, passed, problems = {}, False, [f"{type(err).__name__}: {err}"]
        failures += not passed
        if passed and args.failures_only:
            continue
        print(_row(case.name, errors, passed, width))
        for problem in problems:
            print(f"    {problem}")
    return len(cases), failures


def _gradcheck_section(cases, args) -> tuple[int, int]:
    from shardmoe.check.gradcheck import ATOL, EPS, RTOL, layer_gradcheck

    print(f"\ngradcheck: float64 central differences, eps {EPS:g}, atol {ATOL:g}, rtol {RTOL:g}")
    failures = 0
    for case in cases:
        try:
            result = layer_gradcheck(case)
            passed, message = result.passed, result.message
        except Exception as err:
            passed, message = False, f"{type(err).__name__}: {err}"
        failures += not passed
        if passed and args.failures_only:
            continue
        print(f"{case.name}  {'pass' if passed else 'FAIL'}")
        if message:
            print("    " + message.strip().replace("\n", "\n    "))
    return len(cases), failures


@contextlib.contextmanager
def single_threaded():
    """Run torch ops on one thread inside the block.

    The check's shapes are tiny: spreading each op over threads costs more than it
    saves, and on a loaded machine waiting for the threads dominates."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_arguments(args: argparse.Namespace) -> None:
    """--device must name a device torch has here: a missing one made every check fail, which read as
    a numerical failure."""
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device: expected a torch device (cpu, cuda, cuda:0, ...), got {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: expected a device this machine has, got {args.device!r} (no CUDA device)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {args.device!r}")


def run(args: argparse.Namespace) -> int:
    with single_threaded():
        return _run_sections(args)


def _run_sections(args: argparse.Namespace) -> int:
    import torch

    from shardmoe.check import cases as case_sets

    start = time.perf_counter()
    checks = failures = 0
    if args.dtype in ("all", "float64"):
        matrix = case_sets.quick_matrix() if args.quick else case_sets.full_matrix()
        n, f = _compare_section("float64", matrix, torch.float64, args)
        checks, failures = checks + n, failures + f
    precision = case_sets.precision_cases()[: 2 if args.quick else None]
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if args.dtype in ("all", name):
            n, f = _compare_section(name, precision, dtype, args)
            checks, failures = checks + n, failures + f
    if args.gradcheck and args.dtype in ("all", "float64"):
        n, f = _gradcheck_section(case_sets.gradcheck_cases()[: 1 if args.quick else None], args)
        checks, failures = checks + n, failures + f
    elapsed = time.perf_counter() - start
    verdict = "all passed" if not failures else f"{failures} FAILED"
    print(f"\n{checks} checks, {verdict} ({elapsed:.1f} s)")
    return 1 if failures else 0
