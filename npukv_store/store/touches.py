"""LRU touches: which chunks this process used, published to the shared index.

Runs in: any process with a store handle; thread-safe. A daemon thread
("npukv-touch") flushes about once a second.

    note_keys()   - keys a lookup found (resolved to chunk ids at flush time)
    note_chunk()  - a chunk a lookup found (the connector's located chains)
    take()        - pending chunk ids in chain order, for a commit to refresh
    flush()       - write them to the index now

Order (docs/decisions/0070): a lookup notes a whole prefix of a chain, so a
chunk's parent (the chunk holding the block before its first) is noted before
it; touches keep that order, and the index gives earlier chunks newer times,
so a parent always outlives its children in the LRU. Reads note nothing: the
lookup that found the blocks touched them, and a read of a chain's tail alone
(the blocks a GPU cache lacks) would make a child newer than its parent.

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

from npukv_store.store.index import Index, InTxn

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0  # how stale the shared LRU may get for read-only processes
#: the soonest a flush asked for early (:meth:`TouchRecorder.soon`) follows
#: the last one: a burst of declined saves costs one transaction, not many
SOON_GAP_S = 0.02


class TouchRecorder:
    """Pending LRU touches of one store handle."""

    def __init__(self, index: Callable[[], Index]) -> None:
        """``index`` returns the handle's current index (it changes after fork)."""
        self._index = index
        self._lock = threading.Lock()
        # insertion-ordered, keys (bytes) and chunk ids (int) alike: chain
        # order, parents first (0070), and Index.locate reads a chain a chunk
        # at a time (docs/decisions/0060). The types keep them apart, so a
        # lookup adds its keys as they are (a prefix byte per key cost a
        # 256-key lookup 20 us).
        self._noted: dict[bytes | int, None] = {}
        #: run after each flush (the publisher's deferred unlinks)
        self.after_flush: Callable[[], object] | None = None
        self._stop = threading.Event()
        self._soon = threading.Event()
        self._thread: threading.Thread | None = None
        #: more for the flush's transaction to do (admission's pending
        #: changes: :mod:`.admitter`), or None
        self.also: Callable[[], InTxn | None] | None = None

    def note_keys(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._noted.update(dict.fromkeys(keys))
        self._ensure_thread()

    def note_chunk(self, chunk_id: int) -> None:
        """A chunk a lookup found; chunks are noted in chain order."""
        with self._lock:
            self._noted[chunk_id] = None
        self._ensure_thread()

    def wake(self) -> None:
        """Make sure the flusher runs (for :attr:`also`'s pending changes)."""
        self._ensure_thread()

    def soon(self) -> None:
        """Flush within :data:`SOON_GAP_S`, not at the next second: a save
        declined whole has no commit to carry its ghost entries, and the
        directory's other processes should see them before they decline the
        same blocks again (admission, docs/decisions/0069)."""
        self._soon.set()
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._loop, name="npukv-touch", daemon=True
                )
                self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._soon.wait(FLUSH_INTERVAL_S)
            self._soon.clear()
            if self._stop.is_set():
                return
            self.flush()
            self._stop.wait(SOON_GAP_S)

    def take(self) -> list[bytes]:
        """Pending chunk ids in the order noted, each once (the lookups'
        keys resolved now); clears them."""
        with self._lock:
            noted, self._noted = list(self._noted), {}
        keys = [entry for entry in noted if isinstance(entry, bytes)]
        found = iter(self._index().locate(keys) if keys else ())
        chunk_ids: dict[bytes, None] = {}
        for entry in noted:
            if isinstance(entry, int):
                chunk_ids[entry.to_bytes(8, "little")] = None
            elif (location := next(found)) is not None:
                chunk_ids[location[0].to_bytes(8, "little")] = None
        return list(chunk_ids)

    def flush(self) -> None:
        """Write pending touches to the index now."""
        chunk_ids = self.take()
        extra = self.also() if self.also is not None else None
        if chunk_ids or extra is not None:
            try:
                self._index().touch(chunk_ids, time.time_ns(), in_txn=extra)
            except Exception as exc:  # a cache hint: losing it only ages the chunk
                logger.warning("LRU touch failed: %s", exc)
        if self.after_flush is not None:
            try:
                self.after_flush()
            except Exception as exc:  # deferred unlinks: retried next time
                logger.warning("after the touch flush: %s", exc)

    def stop(self) -> None:
        """Stop the flush thread (waiting for a flush in progress), then flush."""
        self._stop.set()
        self._soon.set()
        thread = self._thread
        if thread is not None:
            thread.join()
        self.flush()

    def reset_after_fork(self) -> None:
        """The parent's thread does not exist in a forked child."""
        with self._lock:
            self._thread = None
            self._noted.clear()
