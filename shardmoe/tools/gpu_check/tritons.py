"""The Triton versions the static stage compiles with, and a way to import one that is not installed.

  PINNED   the version the Makefile installs (`make venv`, `make test`)
  LEASE    the version on the lent GPU machine (its torch's own pin; docs/gpu.md)

The installed triton compiles in a child process as it is. Another version is its release wheel from
the package index (`python -m pip download triton==V --no-deps`: one file, about 190 MB), unpacked once
into CACHE/triton-V (about 640 MB; CACHE is $SHARDMOE_CACHE, else $XDG_CACHE_HOME/shardmoe, else
~/.cache/shardmoe), and imported by a child process that puts that directory first on sys.path: no second
virtual environment, and torch stays the installed one (the compile needs only its meta tensors). A
machine without the package index (a lent GPU machine) compiles with its own triton only, and says why.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PINNED = "3.9.0"
LEASE = "3.6.0"
VERSIONS = (PINNED, LEASE)
FETCH_TIMEOUT_S = 600


def cache_root() -> Path:
    if os.environ.get("SHARDMOE_CACHE"):
        return Path(os.environ["SHARDMOE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardmoe"


def _extract(wheel: Path, target: Path) -> None:
    """Unpack `wheel` into `target`, keeping each member's permission bits (ptxas, cuobjdump and
    nvdisasm are executables inside the wheel; zipfile's own extraction drops the bits)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            path = Path(archive.extract(member, target))
            mode = member.external_attr >> 16
            if mode and not member.is_dir():
                path.chmod(stat.S_IMODE(mode))


def unpacked(version: str) -> tuple[Path | None, str | None]:
    """(the directory holding triton `version` as an importable package, None), fetching and unpacking
    its wheel the first time; (None, why) when it cannot be had here."""
    target = cache_root() / f"triton-{version}"
    if (target / "triton" / "__init__.py").exists():
        return target, None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"triton-{version}-", dir=target.parent) as work:
        try:
            done = subprocess.run([sys.executable, "-m", "pip", "download", f"triton=={version}", "--no-deps",
                                   "--only-binary=:all:", "--disable-pip-version-check", "-q", "--retries", "0",
                                   "--timeout", "15", "-d", work],
                                  capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None, f"pip download triton=={version} took over {FETCH_TIMEOUT_S} s"
        wheels = list(Path(work).glob("triton-*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            return None, (f"pip download triton=={version} failed ({done.returncode}): "
                          f"{(done.stderr or done.stdout).strip()[-300:]}")
        staging = Path(work) / "unpacked"
        _extract(wheels[0], staging)
        try:
            staging.rename(target)
        except OSError:  # another process unpacked it meanwhile
            if not (target / "triton" / "__init__.py").exists():
                raise
            shutil.rmtree(staging, ignore_errors=True)
    return target, None


def installed() -> str | None:
    """The installed triton's version, None when it cannot be imported."""
    try:
        import triton
    except Exception:  # absent or broken: the static stage says so through compiled.toolchain()
        return None
    return triton.__version__
