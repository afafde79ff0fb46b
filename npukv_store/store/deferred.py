"""Deferred unlinks: the files of evicted chunks that were used within
``evict_grace_s`` stay on disk until the grace since their last use is over
(docs/decisions/0070).

Runs in: any process with a store handle; thread-safe (the writer thread's
commits, the touch flusher and close all sweep).

    DeferredUnlinks.split() - which victims of a commit may go now, which wait
    DeferredUnlinks.due()   - the waiting records whose time has come (all at
                              close)

A commit takes its victims in LRU order whatever their age, so a full, busy
directory does not refuse saves; their index rows go at once (no new lookup
finds them), and the file of a young victim waits: a reader that located it
before (a scheduler that just counted it as a hit) still opens it and reads
the right bytes. Its tombstone stays in the index's ``dead`` db until the
unlink, so a process killed meanwhile leaves files that recovery or ``npukv
gc`` remove. Recovery in another live process may remove a waiting file
early: that reader then misses, which reads as a load error and a
recompute, never as wrong KV (chunk ids are never reused).

The waiting bytes are bounded (``limit_bytes``: capacity / 16 by default):
beyond it a victim is unlinked at once, with the same outcome for a reader
that located it. So the disk holds at most capacity * 17/16 of chunk files
(plus files in flight) while the index holds at most capacity.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from npukv_store.store.index_rows import ChunkRecord

#: share of the capacity the waiting files may hold
DEFERRED_SHARE = 1 / 16


class DeferredUnlinks:
    """The evicted chunks of one process whose files wait for their grace."""

    def __init__(self, grace_ns: int, limit_bytes: int) -> None:
        self.grace_ns = grace_ns
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[int, ChunkRecord]] = {}  # id -> (due, rec)
        self._bytes = 0

    @property
    def waiting_bytes(self) -> int:
        return self._bytes

    def waiting_ids(self) -> set[int]:
        with self._lock:
            return set(self._waiting)

    def split(
        self, victims: Sequence[ChunkRecord], now_ns: int | None = None
    ) -> list[ChunkRecord]:
        """Keep the victims used within the grace (while the bound allows);
        returns those to unlink now."""
        now = time.time_ns() if now_ns is None else now_ns
        now_list: list[ChunkRecord] = []
        with self._lock:
            for victim in victims:
                due = victim.last_access_ns + self.grace_ns
                if due <= now or self._bytes + victim.size_bytes > self.limit_bytes:
                    now_list.append(victim)
                    continue
                self._waiting[victim.chunk_id] = (due, victim)
                self._bytes += victim.size_bytes
        return now_list

    def due(self, *, everything: bool = False) -> list[ChunkRecord]:
        """The waiting records whose grace is over (``everything``: all, at
        close: a clean close leaves no file behind), taken off the list."""
        if not self._waiting:
            return []
        now = time.time_ns()
        with self._lock:
            gone = [
                cid
                for cid, (due, _) in self._waiting.items()
                if everything or due <= now
            ]
            records = [self._waiting.pop(cid)[1] for cid in gone]
            self._bytes -= sum(r.size_bytes for r in records)
        return records
