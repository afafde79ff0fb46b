"""Store policy: which chunks are evicted or compacted, and which reads may fill
the page cache. Pure functions, no I/O, no LMDB.

Runs in: any process. The index calls the eviction rule inside its single write
transaction (so the choice and the removal are one atomic step); the
maintenance job calls the compaction rules; the chunk reader calls the
admission rule (the read thresholds are in ``read_plan.ReadTuning``). Keeping
them here means one rule for the writer and for maintenance, and tests that
need no index.

    pick_victims()        - oldest chunks that cover an excess, sparing the young
    excess_bytes()        - bytes over a target fraction of capacity
    rewrite_candidates()  - chunks whose live fraction is below a threshold
    merge_groups()        - small chunks of one namespace, grouped up to a target
    admit_on_read()       - whether a read of a chunk may fill the page cache
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar


class ChunkFacts(Protocol):
    """What the rules need to know of one published chunk (the index's
    ``ChunkRecord`` has these; tests pass plain objects)."""

    @property
    def chunk_id(self) -> int: ...
    @property
    def namespace(self) -> bytes: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def live_rows(self) -> int: ...
    @property
    def created_ns(self) -> int: ...


def live_fraction(chunk: ChunkFacts) -> float:
    """The share of a chunk's rows some key still points to."""
    return chunk.live_rows / chunk.num_rows if chunk.num_rows else 0.0


# -- eviction --------------------------------------------------------------------


def pick_victims(
    oldest_first: Iterable[tuple[int, int]],
    size_of: Callable[[int], int],
    excess: int,
    young_after_ns: int,
) -> list[int] | None:
    """Chunk ids to evict so that ``excess`` bytes go, oldest first.

    Args:
        oldest_first: ``(last access ns, chunk id)`` in LRU order, consumed
            lazily (the index passes its cursor: a commit that needs one victim
            reads one entry).
        size_of: a chunk's size in bytes.
        excess: bytes to free; <= 0 needs no victim.
        young_after_ns: chunks used after this instant are spared (the grace
            period: a scheduler may have just counted them as a hit).

    Returns:
        The victims, or None when the evictable chunks cannot cover ``excess``:
        the caller refuses the new chunk rather than evict hot data.
    """
    victims: list[int] = []
    if excess <= 0:
        return victims
    for last_ns, chunk_id in oldest_first:
        if last_ns > young_after_ns:
            return None  # the rest is younger still
        victims.append(chunk_id)
        excess -= size_of(chunk_id)
        if excess <= 0:
            return victims
    return None


def excess_bytes(total_bytes: int, capacity_bytes: int, target_fraction: float) -> int:
    """Bytes above ``target_fraction`` of capacity (what eviction down to a
    target must free; <= 0 when already below)."""
    if not 0.0 <= target_fraction <= 1.0:
        raise ValueError(f"target fraction: found {target_fraction}, expected 0..1")
    return total_bytes - int(capacity_bytes * target_fraction)


# -- compaction ------------------------------------------------------------------


Chunk = TypeVar("Chunk", bound=ChunkFacts)


def rewrite_candidates(chunks: Iterable[Chunk], min_live: float) -> list[Chunk]:
    """Chunks whose live fraction is below ``min_live``: rewriting them keeps
    their live rows and returns the dead ones' bytes."""
    return [c for c in chunks if live_fraction(c) < min_live]


def merge_groups(
    chunks: Sequence[Chunk], target_bytes: int, *, small_below: float = 0.5
) -> list[list[Chunk]]:
    """Groups of chunks to rewrite as one, per namespace, each up to about
    ``target_bytes`` of live data.

    Candidates are the chunks smaller than ``small_below * target_bytes`` (decode
    saves make one small chunk per step; a prompt's save is already large).
    Within a namespace chunks stay in creation order, so the blocks of one
    prompt, saved step after step, stay next to each other in the new file and
    a prefix read walks one file front to back. A group of one chunk is left
    alone unless it has dead rows (rewriting it alone gains nothing else).
    """
    limit = small_below * target_bytes
    by_ns: dict[bytes, list[Chunk]] = {}
    for chunk in sorted(chunks, key=lambda c: (c.created_ns, c.chunk_id)):
        if chunk.size_bytes < limit:
            by_ns.setdefault(chunk.namespace, []).append(chunk)
    groups: list[list[Chunk]] = []
    for members in by_ns.values():
        group: list[Chunk] = []
        live_bytes = 0
        for chunk in members:
            live = _live_bytes(chunk)
            if group and live_bytes + live > target_bytes:
                groups.append(group)
                group, live_bytes = [], 0
            group.append(chunk)
            live_bytes += live
        if group:
            groups.append(group)
    return [g for g in groups if len(g) > 1 or g[0].live_rows < g[0].num_rows]


def _live_bytes(chunk: ChunkFacts) -> int:
    return chunk.size_bytes * chunk.live_rows // max(chunk.num_rows, 1)


def dead_bytes(chunk: ChunkFacts) -> int:
    """Bytes of ``chunk`` held by rows no key points to (an estimate: the
    header is shared by all rows)."""
    dead_rows = chunk.num_rows - chunk.live_rows
    return chunk.size_bytes * dead_rows // max(chunk.num_rows, 1)


# -- page-cache admission ----------------------------------------------------------


def admit_on_read(read_before: bool) -> bool:
    """Whether a read of a chunk goes through (and so fills) the page cache.

    The first read of a chunk goes around it, a second one is buffered: KV
    read once does not push other data out of memory, and a hot prefix
    becomes a warm hit from its second use (docs/decisions/0012).
    """
    return read_before
