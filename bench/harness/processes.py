"""The child processes of the harnesses: how they start, and that they end.

    python_module()   the command line of ``python -m MODULE ...`` with this
                      interpreter (a harness, a benchmark's helper process)
    child_env()       os.environ with the repository root first on PYTHONPATH:
                      the child imports ``bench`` and ``tests`` (vLLM loads the
                      memory and test connectors by module path), whatever
                      its working directory
    die_with_parent() a ``preexec_fn``: the kernel kills the child when the
                      thread that started it exits (a killed pytest or
                      benchmark leaves no Mooncake master or vLLM behind)
    reap(), reaping() end a child on every path
    in_process()      ``fn(*args)`` in a spawned process, its result or its
                      error brought back (the scale benchmark's cases)

A ``subprocess.Popen`` that is never waited for warns from its ``__del__``
("subprocess N is still running") whenever the garbage collector gets to it,
which pytest (warnings are errors there) reports as a
``PytestUnraisableExceptionWarning`` of whatever test runs at that moment; a
``multiprocessing.Process`` left running holds its files and locks into later
tests. Every test that starts a child ends it with :func:`reap` in a
``finally`` (or through :func:`reaping`), whatever the test did meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing.process
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

from bench import ROOT

__all__ = ["child_env", "die_with_parent", "python_module", "reap", "reaping"]


def python_module(module: str, *args: str) -> list[str]:
    """``python -m module args...`` with this interpreter; run it with
    :func:`child_env` (or from the repository root)."""
    return [sys.executable, "-m", module, *args]


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment, the repository root first on PYTHONPATH,
    then ``overrides``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.update(overrides)
    return env


def _resolve_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None).prctl
        return prctl
    except (OSError, AttributeError):  # not Linux or no glibc: go without
        return None


# Looked up here, in the parent: the child between fork and exec should only
# make the call, not load anything.
_PRCTL = _resolve_prctl()
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in the child before exec: if the parent is killed, the kernel
    kills the child too instead of leaving it running. The setting survives
    an entry point's execv into the real binary. (It fires when the thread
    that started the child exits, so start children from the main thread.)"""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def reap(proc: Any, timeout_s: float = 30.0) -> None:
    """Kill ``proc`` (a ``subprocess.Popen`` or a ``multiprocessing``
    process; None is ignored) if it still runs, wait for it, and close its
    pipes. Safe to call on a process that was already waited for, and twice."""
    if proc is None:
        return
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # SIGKILLed: cannot take long
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        return
    if isinstance(proc, multiprocessing.process.BaseProcess):
        if proc.pid is None:  # never started
            return
        if proc.is_alive():
            proc.kill()
        proc.join(timeout_s)
        return
    raise TypeError(f"reap: found {type(proc).__name__}, expected a process")


@contextlib.contextmanager
def reaping(*procs: Any) -> Iterator[None]:
    """``with reaping(a, b):`` reaps ``a`` and ``b`` on leaving, on every path."""
    try:
        yield
    finally:
        for proc in procs:
            reap(proc)


def _run_and_report(fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    try:
        out.put(("ok", fn(*args)))
    except BaseException as exc:  # reported to the parent, which raises it
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def in_process(fn: Callable[..., Any], *args: Any, timeout_s: float = 3600) -> Any:
    """``fn(*args)`` (both picklable) in a spawned process, as the operator's
    commands and the servers run: what it holds of a directory (a lock, a
    session) it lets go on exit, and what it imports stays out of this
    process. Raises RuntimeError with the child's error."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_run_and_report, args=(fn, args, out))
    proc.start()
    try:
        status, value = out.get(timeout=timeout_s)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}: {value}")
    return value
