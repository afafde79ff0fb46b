"""Child processes of the tests are waited for on every path.

A ``subprocess.Popen`` that is never waited for warns from its ``__del__``
("subprocess N is still running") whenever the garbage collector gets to it,
which pytest (warnings are errors here) reports as a
``PytestUnraisableExceptionWarning`` of whatever test runs at that moment; a
``multiprocessing.Process`` left running holds its files and locks into later
tests. Every test that starts a child ends it with :func:`reap` in a
``finally`` (or through :func:`reaping`), whatever the test did meanwhile.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import subprocess
from collections.abc import Iterator
from typing import Any

__all__ = ["reap", "reaping"]


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
