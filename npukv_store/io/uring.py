"""The io_uring I/O engine: one ring per engine, driven by ``_native.Uring``.

Runs in: the process that made it (a forked child gets RuntimeError and must
make its own); one thread at a time (a second thread inside a method gets
RuntimeError instead of racing on the rings).

    UringEngine - submit() fills one SQE per request and enters the kernel
                  once; reap() waits for completions. The GIL is released in
                  every syscall.

Differences from the thread engine, which is its twin: ``submit`` refuses
(ValueError) more than ``queue_depth`` requests in flight, where the thread
engine queues them; after ``close`` with requests in flight their completions
are gone (close waited for them), and ``reap`` raises ValueError.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from npukv_store import native
from npukv_store.io.engine import Completion, IOEngine, IORequest

if TYPE_CHECKING:
    from npukv_store._native import Uring

logger = logging.getLogger(__name__)
_register_refusal_logged = False


class UringEngine(IOEngine):
    """An io_uring ring with ``queue_depth`` entries.

    Raises:
        ImportError: the C extension is not in use (``NPUKV_NATIVE=0``: the
            twin has no io_uring); make_engine falls back.
        OSError: the kernel refuses io_uring (seccomp, ``io_uring_disabled``)
            or lacks IORING_OP_READ/WRITE (Linux < 5.6).
        ValueError: ``queue_depth`` outside 1..4096.
    """

    kind = "uring"

    def __init__(self, queue_depth: int = 16) -> None:
        impl = native.IMPL  # every build has Uring (native/uring.c)
        if impl is None:
            raise ImportError(
                "io_uring engine: found NPUKV_NATIVE=0 (the pure-Python twin), "
                "expected the C extension's npukv_store._native.Uring"
            )
        self.queue_depth = queue_depth
        # With several reads in flight, punt them to io_uring's workers: cached
        # pages are then copied on several cores instead of inline on ours
        # (measured in docs/decisions/0013). One read at a time stays inline.
        self._ring: Uring = impl.Uring(queue_depth, punt_reads=queue_depth > 1)

    @property
    def in_flight(self) -> int:
        return self._ring.in_flight

    def submit(self, requests: Sequence[IORequest]) -> None:
        self._ring.submit(
            [(req.op, req.fd, req.offset, req.buffer, req.tag) for req in requests]
        )

    def reap(self, min_complete: int = 1) -> list[Completion]:
        return [Completion(tag, res) for tag, res in self._ring.reap(min_complete)]

    def register_buffer(self, buffer: memoryview) -> bool:
        """io_uring fixed buffers. A refusal (RLIMIT_MEMLOCK in a container,
        an old kernel) is logged once per process and leaves the engine as it
        was: requests then pin their pages one by one, as without."""
        global _register_refusal_logged
        try:
            self._ring.register_buffer(buffer)
        except OSError as exc:
            if not _register_refusal_logged:
                _register_refusal_logged = True
                logger.info(
                    "io_uring buffer registration refused (%s); writes "
                    "from the ring pin pages per request",
                    exc,
                )
            return False
        return True

    @property
    def fixed_submitted(self) -> int:
        """Requests sent through the registered buffer so far."""
        return self._ring.fixed_submitted

    def close(self) -> None:
        self._ring.close()

    def fileno(self) -> int:
        """The ring's fd (for polling it); ValueError once closed."""
        return self._ring.fileno()
