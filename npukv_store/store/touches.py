"""LRU touches: which chunks this process used, published to the shared index.

Runs in: any process with a store handle; thread-safe. A daemon thread
("npukv-touch") flushes about once a second.

    note_keys()   - keys a lookup found (resolved to chunk ids at flush time)
    note_chunk()  - a chunk a read used
    take()        - pending chunk ids, for a commit transaction to refresh
    flush()       - write them to the index now

A lookup or read must not take the index write lock (readers are never blocked
by writers), so touches are only collected in memory on those paths and written
later: in the next put's commit transaction or by the flush thread. A process
killed before a flush loses at most a second of recency hints, which only makes
those chunks look older.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from npukv_store.store.index import Index

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0  # how stale the shared LRU may get for read-only processes


class TouchRecorder:
    """Pending LRU touches of one store handle."""

    def __init__(self, index: Callable[[], Index]) -> None:
        """``index`` returns the handle's current index (it changes after fork)."""
        self._index = index
        self._lock = threading.Lock()
        self._chunk_ids: set[bytes] = set()  # 8-byte little-endian chunk ids
        # insertion-ordered: a lookup's chain stays in order, and
        # Index.locate reads a chain a chunk at a time (docs/decisions/0060)
        self._keys: dict[bytes, None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def note_keys(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._keys.update(dict.fromkeys(keys))
        self._ensure_thread()

    def note_chunk(self, chunk_id: int) -> None:
        with self._lock:
            self._chunk_ids.add(chunk_id.to_bytes(8, "little"))
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._loop, name="npukv-touch", daemon=True
                )
                self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            self.flush()

    def take(self) -> set[bytes]:
        """Pending chunk ids (the lookups' keys resolved now); clears them."""
        with self._lock:
            chunk_ids, self._chunk_ids = self._chunk_ids, set()
            keys, self._keys = list(self._keys), {}
        for location in self._index().locate(keys) if keys else ():
            if location is not None:
                chunk_ids.add(location[0].to_bytes(8, "little"))
        return chunk_ids

    def flush(self) -> None:
        """Write pending touches to the index now."""
        chunk_ids = self.take()
        if chunk_ids:
            try:
                self._index().touch(chunk_ids, time.time_ns())
            except Exception as exc:  # a cache hint: losing it only ages the chunk
                logger.warning("LRU touch failed: %s", exc)

    def stop(self) -> None:
        """Stop the flush thread (waiting for a flush in progress), then flush."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join()
        self.flush()

    def reset_after_fork(self) -> None:
        """The parent's thread does not exist in a forked child."""
        with self._lock:
            self._thread = None
            self._chunk_ids.clear()
            self._keys.clear()
