"""The thread-pool I/O engine: os.preadv / os.pwritev on worker threads.

Runs in: any process. The fallback where io_uring is unavailable (old kernels,
seccomp profiles in default container setups) and the pure-Python twin the
io_uring backend is tested against. The syscalls release the GIL, so
``queue_depth`` threads keep that many requests at the disk.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from npukv_store.io.engine import READ, Completion, IOEngine, IORequest

logger = logging.getLogger(__name__)


class ThreadEngine(IOEngine):
    """``queue_depth`` worker threads; completions arrive on a queue."""

    kind = "threads"

    def __init__(self, queue_depth: int = 16) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth: found {queue_depth}, expected >= 1")
        self.queue_depth = queue_depth
        self._pool = ThreadPoolExecutor(queue_depth, thread_name_prefix="npukv-io")
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._in_flight = 0
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, requests: Sequence[IORequest]) -> None:
        if self._closed:
            raise ValueError("submit on a closed engine")
        for request in requests:
            self._in_flight += 1
            self._pool.submit(self._one, request)

    def _one(self, request: IORequest) -> None:
        try:
            buffers = (
                list(request.buffer)
                if isinstance(request.buffer, tuple)
                else [request.buffer]
            )
            if request.op == READ:
                moved = os.preadv(request.fd, buffers, request.offset)
            else:
                moved = os.pwritev(request.fd, buffers, request.offset)
            self._done.put(Completion(request.tag, moved))
        except OSError as exc:
            self._done.put(Completion(request.tag, -(exc.errno or errno.EIO)))
        except Exception:  # a bad buffer (read-only, not a buffer): still complete
            logger.warning("I/O request %r refused", request.tag, exc_info=True)
            self._done.put(Completion(request.tag, -errno.EINVAL))

    def reap(self, min_complete: int = 1) -> list[Completion]:
        want = min(min_complete, self._in_flight)
        out = [self._done.get() for _ in range(want)]
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._in_flight -= len(out)
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
