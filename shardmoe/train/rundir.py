"""The run directory (`--out DIR`): claimed by one run at a time, never mixed between runs.

claim_run_dir(DIR, resume, overwrite) makes DIR if needed and takes an exclusive, non-blocking
fcntl.flock on DIR/.lock, held until release(). The OS drops a flock when its process dies, so a
crashed or killed run leaves no stale lock: the file stays, the lock does not. Under the lock:

    resume            DIR must hold the earlier run (the checkpoint is checked elsewhere)
    overwrite         the files an earlier run wrote (RUN_FILES, the sharded checkpoint directory) are deleted first
    neither           DIR must be empty (but for .lock): a fresh run into an old run's directory
                      would rewrite metrics.jsonl at once yet keep the old checkpoint until its
                      own first one, and a later --resume would splice the two runs

Every refusal is a ValueError naming DIR. Only rank 0 claims (it alone writes DIR).
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from shardmoe.train.checkpoint import FILE_NAME as CHECKPOINT_FILE
from shardmoe.train.metrics import METRICS_FILE
from shardmoe.train.run_settings import SETTINGS_FILE
from shardmoe.train.sample import SAMPLES_FILE
from shardmoe.train.sharded_checkpoint import DIR_NAME as SHARDED_CHECKPOINT_DIR

LOCK_FILE = ".lock"
CURVE_FILE = "loss_curve.png"
LOAD_FILE = "expert_load.png"
RUN_FILES = tuple(name + suffix for name in (METRICS_FILE, CHECKPOINT_FILE, SETTINGS_FILE, SAMPLES_FILE)
                  for suffix in ("", ".tmp")) + (CURVE_FILE, LOAD_FILE)


class RunDirLock:
    """The held lock on a run directory; release() (or process exit) frees it."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = -1


def claim_run_dir(out_dir: str | Path, *, resume: bool, overwrite: bool) -> RunDirLock:
    """Lock DIR for this run and check (or clear) what it holds; see the module doc."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: expected a directory, got an existing file")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ValueError(f"--out {out}: cannot create the run directory ({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _claimed_by_another(out, fd) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message a second run prints
    lock = RunDirLock(out, fd)
    try:
        _check_contents(out, resume, overwrite)
    except BaseException:
        lock.release()
        raise
    return lock


def check_claimable(out_dir: str | Path, *, resume: bool, overwrite: bool) -> None:
    """The refusals of claim_run_dir that need no lock of our own (an --out that is a file, a live
    run holding DIR, a new run into a directory holding a run), checked read-only before the work
    that precedes the claim (tokenizing the data), so that they come first. claim_run_dir checks
    again under the lock."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: expected a directory, got an existing file")
    check_unclaimed(out)  # a live run there is named as such, whatever its files look like
    if out.is_dir():
        _check_contents(out, resume=resume or overwrite, overwrite=False)


def check_unclaimed(out_dir: str | Path) -> None:
    """ValueError if another live run holds DIR's lock (nothing is created or kept): checked before
    a --resume reads the checkpoint, which that run may be replacing, so the refusal names the
    run rather than whatever its files look like mid-write. claim_run_dir checks again."""
    lock_path = Path(out_dir) / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return  # no lock file: no run has claimed DIR (or DIR is unusable, which the claim reports)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _claimed_by_another(Path(out_dir), fd) from None
    os.close(fd)


def _claimed_by_another(out: Path, fd: int) -> ValueError:
    """The refusal for a DIR whose lock another process holds (closes fd, read for the holder's pid)."""
    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    os.close(fd)
    return ValueError(f"--out {out}: another run (pid {holder}) is writing this directory; wait for it "
                      "or choose another --out")


def _check_contents(out: Path, resume: bool, overwrite: bool) -> None:
    if resume:
        return
    if overwrite:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        if (out / SHARDED_CHECKPOINT_DIR).exists():  # a failure is reported: its LATEST must not survive
            shutil.rmtree(out / SHARDED_CHECKPOINT_DIR)
        return
    held = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE)
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ValueError(f"--out {out}: expected an empty directory for a new run, but it holds {shown}; "
                         "pass --resume to continue that run or --overwrite to replace it")
