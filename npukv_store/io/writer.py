"""The background writer: turns committed ring regions into published chunks.

Runs in: a worker process, as one daemon thread ("npukv-writer") per store
handle. ``submit()`` is called by the producer (never blocks); everything else
happens on the writer thread, whose waiting and I/O release the GIL.

    submit()  - queue a filled batch (FIFO)
    flush()   - wait until every batch submitted so far is visible to others
    close()   - drain complete batches, drop incomplete ones, stop the thread
    write_image() - write a chunk image from memory with a few large requests

Per batch the thread waits for the batch's device event (D2H copy into the
ring; None or already complete on the CPU), then calls ``publish(batch)``
(the store's ``AsyncSaver._publish`` in store/write/staging.py: checksums,
write through the engine, fsync, rename, index commit), then releases the ring
region, unless publish set ``batch.held`` (the remote tier still reads it and
releases it itself). A failure in publish is logged and counted; the batch is
lost, never half-visible, and the thread goes on with the next one.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from npukv_store import native
from npukv_store.errors import IOEngineError
from npukv_store.io.engine import WRITE, Completion, IOEngine, IORequest
from npukv_store.io.ring import Region, StagingRing

logger = logging.getLogger(__name__)

#: Bytes per write request: large enough to be few, small enough that several
#: are in flight at once (queue depth) and buffered writes stay fast.
WRITE_PIECE_BYTES = 4 << 20


class Event(Protocol):
    """What a batch waits for before its bytes are read (a device event)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(slots=True)
class SaveBatch:
    """One chunk's worth of blocks staged in a ring region.

    ``image`` is the region's first ``file_bytes`` bytes: header, data section,
    checksum table (filled by publish), exactly the chunk file to write.
    """

    region: Region
    image: np.ndarray
    keys: tuple[bytes, ...]
    chunk_id: int
    created_ns: int
    event: Event | None = None
    #: who publishes it: one ring may carry the batches of several namespaces
    #: (a hybrid model's KV cache groups); opaque to the writer
    owner: object = None
    #: publish handed the region on (to a remote put, which releases it when
    #: its reads are done); the writer then leaves it alone
    held: bool = False
    #: also written to the remote tier once published (not for blocks that
    #: came from it)
    to_remote: bool = True

    def ready(self) -> bool:
        """Whether the batch's bytes are complete (its event has fired)."""
        return self.event is None or self.event.query()


class BackgroundWriter:
    """One thread that publishes batches in submission order."""

    def __init__(
        self,
        ring: StagingRing,
        publish: Callable[[SaveBatch], None],
        discard: Callable[[SaveBatch], None],
    ) -> None:
        """
        Args:
            ring: where the batches' regions live; released after each batch.
            publish: makes a batch's chunk visible (runs on the writer thread).
            discard: undoes a batch's bookkeeping when it is dropped at close.
        """
        self._ring = ring
        self._publish = publish
        self._discard = discard
        self._queue: deque[SaveBatch] = deque()
        self._cond = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._closing = False
        self._thread = threading.Thread(
            target=self._run, name="npukv-writer", daemon=True
        )
        self._thread.start()

    def submit(self, batch: SaveBatch) -> None:
        """Queue ``batch``; returns at once."""
        with self._cond:
            if self._closing:
                raise ValueError("submit on a closed writer")
            self._queue.append(batch)
            self._submitted += 1
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every batch submitted before this call is published (or
        has failed). Returns False on timeout."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._finished >= target, timeout_s)

    def close(self) -> None:
        """Publish the batches that are complete, drop the rest, stop. Idempotent."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                batch = self._queue.popleft()
                closing = self._closing
            if closing and not batch.ready():
                self._drop(batch)  # its device copy never finished: nothing to save
            else:
                self._write(batch)
            with self._cond:
                self._finished += 1
                self._cond.notify_all()

    def _write(self, batch: SaveBatch) -> None:
        try:
            if batch.event is not None:
                batch.event.synchronize()
            self._publish(batch)
        except Exception as exc:  # one lost batch; the writer and the server go on
            # An I/O failure (a full disk) is one line per batch; anything else
            # is a bug and keeps its traceback.
            logger.warning(
                "save batch of chunk %016x failed: %s; dropped",
                batch.chunk_id, exc, exc_info=not isinstance(exc, OSError),
            )  # fmt: skip
            self._discard(batch)
        finally:
            if not batch.held:
                self._ring.release(batch.region)

    def _drop(self, batch: SaveBatch) -> None:
        try:
            self._discard(batch)
        finally:
            self._ring.release(batch.region)


def write_image(
    engine: IOEngine,
    fd: int,
    image: np.ndarray,
    *,
    writeback: bool = False,
    tail_offset: int | None = None,
    fill_tail: Callable[[], None] | None = None,
) -> int:
    """Write ``image`` at offset 0 of ``fd`` in pieces of WRITE_PIECE_BYTES,
    queue_depth at a time. Returns the bytes written.

    Args:
        writeback: start each piece's writeback as soon as it completes
            (buffered files that will be fsynced: the disk works while later
            pieces are written, instead of all at the fsync).
        tail_offset, fill_tail: bytes from ``tail_offset`` on are not final
            yet: ``fill_tail()`` (the checksum table, GIL-free) runs on its own
            thread while every piece before ``tail_offset`` is written, and the
            rest follows once it returns.

    Raises:
        IOEngineError: a piece failed or was short (the caller removes the file).
    """
    view = image.data.cast("B")
    requests = [
        IORequest(WRITE, fd, offset, view[offset : offset + WRITE_PIECE_BYTES], offset)
        for offset in range(0, len(view), WRITE_PIECE_BYTES)
    ]
    try:
        if fill_tail is not None:
            tail = len(view) if tail_offset is None else tail_offset
            early = [r for r in requests if r.offset + len(r.buffer) <= tail]
            with _BackgroundCall(fill_tail):  # GIL-free hashing beside the writes
                _check_writes(engine.stream(early), fd, len(view), writeback)
            requests = requests[len(early) :]
        _check_writes(engine.stream(requests), fd, len(view), writeback)
    except BaseException:
        while engine.in_flight:  # no stale completion may reach the next chunk
            engine.reap(engine.in_flight)
        raise
    return len(view)


class _BackgroundCall:
    """Run ``fn`` on a short-lived thread for the duration of a ``with`` block;
    its exception, if any, is raised at the end of the block."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="npukv-checksum")

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # handed to the caller in __exit__
            self._error = exc

    def __enter__(self) -> None:
        self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _check_writes(
    completions: Iterator[Completion], fd: int, total: int, writeback: bool
) -> None:
    for done in completions:
        expected = min(WRITE_PIECE_BYTES, total - done.tag)
        if done.result != expected:
            errno = -done.result if done.result < 0 else 28  # short write: ENOSPC
            raise IOEngineError(
                errno,
                f"chunk write at offset {done.tag}: {done.result} of {expected} bytes",
            )
        if writeback:
            native.sync_file_range_write(fd, done.tag, expected)
