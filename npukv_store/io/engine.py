"""The I/O engine API: submit a batch of reads and writes, then reap completions.

Runs in: any process; one engine per user (not shared between threads).

    IORequest   - one read or write: an fd, an offset and a buffer
    Completion  - its tag and the bytes moved, or -errno
    IOEngine    - submit() / reap(); stream() and run() keep queue_depth in flight
    make_engine - "auto" | "uring" | "threads"; with NPUKV_FAULTS set (tests
                  only, off by default) wrapped in testing/faults.py's FaultyEngine

The engine never retries: a short read (EOF) or short write comes back as the
byte count it was, an error as ``-errno``. Callers decide what that means; the
store treats any of it as a miss. Buffers must stay alive and unmodified until
their completion is reaped.
"""

from __future__ import annotations

import importlib
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from npukv_store.errors import ConfigError

logger = logging.getLogger(__name__)

READ = 0
WRITE = 1


@dataclass(frozen=True, slots=True)
class IORequest:
    """One I/O: ``op`` (READ into / WRITE from ``buffer``) at ``offset`` of ``fd``.

    A tuple of buffers is one vectored I/O (preadv/pwritev, READV/WRITEV): the
    file range is as long as all of them, taken in order. The result is the
    total bytes moved."""

    op: int
    fd: int
    offset: int
    buffer: memoryview | tuple[memoryview, ...]
    tag: int


@dataclass(frozen=True, slots=True)
class Completion:
    """The outcome of the request with ``tag``: bytes moved (>= 0) or -errno."""

    tag: int
    result: int


class IOEngine(ABC):
    """An I/O backend. Not thread-safe: one user thread per engine."""

    kind: str
    queue_depth: int

    @abstractmethod
    def submit(self, requests: Sequence[IORequest]) -> None:
        """Start ``requests``; at most ``queue_depth`` may be in flight at once."""

    @abstractmethod
    def reap(self, min_complete: int = 1) -> list[Completion]:
        """Wait for at least ``min_complete`` completions; return all available."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Requests submitted and not yet reaped."""

    @abstractmethod
    def close(self) -> None:
        """Wait for requests in flight, then release the engine. Idempotent."""

    def register_buffer(self, buffer: memoryview) -> bool:
        """Pin ``buffer`` for this engine's lifetime, if the backend can, so
        requests inside it skip per-request page pinning; True if it did. The
        buffer must outlive the engine. The thread engine cannot: False."""
        del buffer
        return False

    def stream(self, requests: Sequence[IORequest]) -> Iterator[Completion]:
        """Do all ``requests`` with at most ``queue_depth`` in flight, yielding
        completions as they arrive (so callers can work on early ones while the
        rest are at the disk).

        A consumer that stops early (an exception in its loop, a ``break``)
        closes the generator: the requests still in flight are then waited for
        and their completions dropped, and the ones not yet submitted never
        are. Left running, they would write into the caller's buffers after it
        has given up on them (a KV page being recomputed, say), and their
        completions would reach the next caller of this engine."""
        pending = list(requests)
        try:
            while pending or self.in_flight:
                room = self.queue_depth - self.in_flight
                if pending and room > 0:
                    self.submit(pending[:room])
                    pending = pending[room:]
                yield from self.reap(1)
        finally:
            while self.in_flight:
                for _ in self.reap(1):
                    pass

    def run(self, requests: Sequence[IORequest]) -> list[Completion]:
        """Do all ``requests``; their completions in completion order."""
        return list(self.stream(requests))

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: kind -> (module, class), imported on first use (a backend that is not built,
#: or whose import fails, is simply unavailable)
_BACKENDS = {
    "uring": ("npukv_store.io.uring", "UringEngine"),
    "threads": ("npukv_store.io.threads", "ThreadEngine"),
}

#: The fault injector make_engine loads where NPUKV_FAULTS is set. By name, as
#: _BACKENDS: it imports this module, so an import of it here would be a
#: circle; and a registry it fills when imported would stay empty in the
#: processes that need it most (a vLLM worker started with NPUKV_FAULTS imports
#: no test code).
FAULTS_MODULE = "npukv_store.testing.faults"


def _construct(kind: str, queue_depth: int) -> IOEngine:
    module_name, class_name = _BACKENDS[kind]
    engine_class = getattr(importlib.import_module(module_name), class_name)
    engine: IOEngine = engine_class(queue_depth)
    return engine


def make_engine(kind: str = "auto", queue_depth: int = 16) -> IOEngine:
    """An engine of ``kind``; "auto" prefers io_uring and falls back to threads
    with one info line. Where the environment sets ``NPUKV_FAULTS`` (the fault
    tests, docs/faults.md), the engine is wrapped to fail the requests it names.

    Raises:
        ConfigError: an unknown kind, or "uring" where it cannot start here.
    """
    engine = _make_engine(kind, queue_depth)
    if os.environ.get("NPUKV_FAULTS"):  # tests only; unset costs this lookup
        wrapped: IOEngine = importlib.import_module(FAULTS_MODULE).wrap_from_env(engine)
        return wrapped
    return engine


def _make_engine(kind: str, queue_depth: int) -> IOEngine:
    if kind not in ("auto", *_BACKENDS):
        raise ConfigError(
            f"io_engine: found {kind!r}, expected auto, {', '.join(_BACKENDS)}"
        )
    if kind == "threads":
        return _construct("threads", queue_depth)
    try:
        return _construct("uring", queue_depth)
    except (ImportError, AttributeError, OSError) as exc:
        if kind == "uring":
            raise ConfigError(
                f"io_engine: found 'uring', but it cannot start here ({exc}); "
                "expected a kernel that allows io_uring, or io_engine=threads"
            ) from exc
        logger.info("io_uring unavailable (%s); using the thread-pool engine", exc)
    return _construct("threads", queue_depth)
