"""Run a function on N ranks of a local process group and bring each rank's result back.

    results = run_distributed(check_all, 4, args=(config,))   # [result of rank 0, ..., rank 3]

Each rank is a fresh process (multiprocessing 'spawn': forking a process that already holds torch
threads is unsafe) with RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE set and the default
process group initialised before ``fn`` runs. The parent hosts the rendezvous store on a port the
OS picks, so parallel runs never race for a port.

It never hangs: collectives time out after ``collective_timeout``; the parent stops waiting after
``timeout`` and kills what is left; and ``report_grace`` seconds after one rank fails the others
are killed (they would otherwise sit in a collective waiting for the dead rank) and RankFailed
carries the failing rank's traceback, the others' tracebacks and the results of the ranks that
finished (a test of how fast a peer notices a failure raises a longer grace).

Spawning costs seconds (every process imports torch), so group many checks into one world.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"
_SILENT = "process exited with code"


class RankFailed(RuntimeError):
    """A rank raised (or died); ``rank`` is the first to report and ``details`` its traceback;
    ``others`` the tracebacks of the other ranks that failed, ``results`` the results of the ranks
    that finished, each by rank."""

    def __init__(self, rank: int, details: str, others: dict[int, str], results: dict[int, Any]):
        self.rank, self.details, self.others, self.results = rank, details, others, results
        lines = [f"rank {rank} failed:\n{details.rstrip()}"]
        for other, text in sorted(others.items()):
            last = text.strip().splitlines()[-1] if text.strip() else ""
            lines.append(f"rank {other} also failed: {last}")
        super().__init__("\n".join(lines))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
    ranks_per_node: int | None = None,
    backend: str = "gloo",
    report_grace: float = 0.5,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    fn: a module-level function (it is looked up by module and name in each rank, falling back to
        the file it was defined in, so test modules work under any pytest import mode).
    args, kwargs, results: picklable.
    timeout: seconds for the whole run; past it the ranks are killed and TimeoutError is raised.
    collective_timeout: seconds a rank waits in init or a collective before failing.
    ranks_per_node: LOCAL_WORLD_SIZE each rank sees (default world_size: one node); lets a test
        pretend the ranks span several nodes.
    backend: 'gloo' (CPU) or 'nccl' (one GPU per rank, LOCAL_RANK picks it).
    report_grace: seconds to wait, after the first failure, for the other ranks' reports.
    Raises RankFailed when a rank raises or exits without reporting.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node = {ranks_per_node} must be positive and divide world_size = {world_size}")
    if not report_grace >= 0:
        raise ValueError(f"report_grace: expected seconds >= 0, got {report_grace!r}")
    target = _function_ref(fn)
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    ctx = _context()
    reports = ctx.Queue()
    settings = (world_size, ranks_per_node, store.port, backend, collective_timeout)
    processes = [
        ctx.Process(target=_rank_main, args=(rank, settings, target, tuple(args), kwargs or {}, reports), daemon=True)
        for rank in range(world_size)
    ]
    try:
        for p in processes:
            p.start()
        return _collect(processes, reports, timeout, report_grace)
    finally:
        _stop(processes)
        reports.close()
        del store


def _context():
    # A fork server imports torch once per parent process and forks every later rank from it: a
    # rank then starts in a fraction of a second instead of re-importing torch. The server forks
    # before any torch thread pool exists, so its children are as clean as spawned ones.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardmoe.testing.distributed"])
    return ctx


def _collect(processes, reports, timeout: float, report_grace: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    first_failure_at = None
    while len(results) + len(failures) < len(processes):
        now = time.monotonic()
        if first_failure_at is not None and now > first_failure_at + report_grace:
            break
        if now > deadline:
            missing = [r for r in range(len(processes)) if r not in results and r not in failures]
            if failures:
                break
            raise TimeoutError(f"run_distributed: ranks {missing} did not finish within {timeout:g} s; killed them")
        try:
            rank, ok, payload = reports.get(timeout=0.05)
        except queue.Empty:
            _note_silent_deaths(processes, reports, results, failures)
        else:
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
    if failures:
        # A rank that died without a word is the cause of its peers' broken collectives, never their
        # consequence; otherwise the first report to arrive is the cause.
        silent = [r for r, text in failures.items() if text.startswith(_SILENT)]
        first = silent[0] if silent else next(iter(failures))
        raise RankFailed(first, failures[first], {r: t for r, t in failures.items() if r != first}, results)
    return [results[r] for r in range(len(processes))]


def _note_silent_deaths(processes, reports, results, failures) -> None:
    """Record ranks whose process ended without a report (crash, os._exit, killed)."""
    for rank, p in enumerate(processes):
        if rank in results or rank in failures or p.exitcode is None:
            continue
        # A report sent just before exiting may still be in the pipe: drain before judging.
        try:
            while True:
                other, ok, payload = reports.get(timeout=0.2)
                (results if ok else failures)[other] = pickle.loads(payload) if ok else payload
        except queue.Empty:
            pass
        if rank not in results and rank not in failures:
            failures[rank] = f"{_SILENT} {p.exitcode} without reporting a result"


def _stop(processes) -> None:
    started = [p for p in processes if p.pid is not None]  # a failed start leaves the rest unstarted
    for p in started:
        if p.is_alive():
            p.terminate()
    for p in started:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(rank: int, settings, target, args, kwargs, reports) -> None:
    world_size, ranks_per_node, port, backend, collective_timeout = settings
    local_rank = rank % ranks_per_node
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # N ranks share the machine's cores
    try:
        fn = _resolve(*target)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        wait = datetime.timedelta(seconds=collective_timeout)
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=wait)
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store, timeout=wait)
        payload = pickle.dumps(fn(*args, **kwargs))
        reports.put((rank, True, payload))
    except BaseException:
        reports.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _function_ref(fn) -> tuple[str, str, str | None]:
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or not qualname or "<" in qualname:
        raise ValueError(f"run_distributed needs a module-level function, got {fn!r}")
    module = sys.modules.get(fn.__module__)
    return fn.__module__, qualname, getattr(module, "__file__", None)


def _resolve(module_name: str, qualname: str, path: str | None):
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    module_file = getattr(module, "__file__", None)
    same_file = module is not None and (
        path is None or (module_file is not None and os.path.samefile(module_file, path))
    )
    if not same_file:
        # pytest's importlib mode gives test modules names that do not import; load them by file.
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
