"""Checks of command-line arguments that several subcommands share (cli.py runs a command's
check_arguments before its work; a ValueError becomes one line and exit code 2)."""
from __future__ import annotations

from pathlib import Path

from shardmoe.moe.config import is_finite_number


def check_out_dir(option: str, path) -> None:
    """Raise ValueError unless directory `path` exists or can be made (it is made here, before the
    work whose results go there)."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{option}: expected a directory that exists or can be made, got {str(path)!r} "
                         f"({err.strerror})") from None


def check_at_least(option: str, value, low) -> None:
    """Raise ValueError unless value is a finite number >= low."""
    if not is_finite_number(value) or value < low:
        raise ValueError(f"{option}: expected a number >= {low}, got {value!r}")


SEED_MAX = 2 ** 64 - 1  # torch.manual_seed and torch.Generator.manual_seed take 64 bits


def check_seed(option: str, value) -> None:
    """Raise ValueError unless value is an int in 0..SEED_MAX (a larger one was an OverflowError
    traceback from torch)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise ValueError(f"{option}: expected an int in 0..{SEED_MAX}, got {value!r}")
