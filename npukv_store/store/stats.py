"""Result and statistics values of the store.

Runs in: any process. ``StoreCounters`` is per handle and thread-safe; the
directory-wide figures come from the index.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

_COUNTERS = (
    "puts",
    "put_blocks",
    "put_bytes",
    "skipped_blocks",
    "declined_blocks",
    "lost_hit_blocks",
    "wasted_write_blocks",
    "queued_blocks",
    "dropped_blocks",
    "failed_batches",
    "rejected_blocks",
    "evicted_chunks",
    "lookups",
    "lookup_blocks",
    "hit_blocks",
    "read_blocks",
    "read_bytes",
    "direct_read_bytes",
    "cached_read_bytes",
    "streamed_read_bytes",
    "read_misses",
    "read_errors",
    "checksum_errors",
    "quarantined_chunks",
)


@dataclass(frozen=True, slots=True)
class PutResult:
    """Rows of one put: stored, skipped (already stored or in flight), rejected
    (no room: every evictable chunk was touched within the grace period); for
    put_async also queued (staged for the writer) and dropped (ring full)."""

    stored: int
    skipped: int
    rejected: int
    queued: int = 0
    dropped: int = 0


class StoreCounters:
    """Monotonic per-handle counters (see ``_COUNTERS`` for the names)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(_COUNTERS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Directory-wide totals plus this handle's counters."""

    total_bytes: int
    capacity_bytes: int
    num_chunks: int
    num_blocks: int
    counters: dict[str, int] = field(default_factory=dict)
    #: save claims in the directory (every process's): 0 once saves are
    #: flushed and no claimant died since the last sweep
    claims_held: int = 0
