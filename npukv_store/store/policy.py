"""Store policy: which chunks are evicted or compacted, and which reads may fill
the page cache. Pure functions, no I/O, no LMDB.

Runs in: any process. The index calls the eviction rule inside its single write
transaction (so the choice and the removal are one atomic step); the
maintenance job calls the compaction rules; the chunk reader calls the
admission rule (the read thresholds are in ``read_plan.ReadTuning``). Keeping
them here means one rule for the writer and for maintenance, and tests that
need no index.

    pick_victims()        - oldest chunks of tenants over their share that cover
                            an excess, sparing the young
    excess_bytes()        - bytes over a target fraction of capacity
    rewrite_candidates()  - chunks whose live fraction is below a threshold
    merge_groups()        - small chunks of one namespace, grouped up to a target
    admit_on_read()       - whether a read of a chunk may fill the page cache
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    @property
    def tenant(self) -> bytes: ...
    @property
    def pinned(self) -> bool: ...


def live_fraction(chunk: ChunkFacts) -> float:
    """The share of a chunk's rows some key still points to."""
    return chunk.live_rows / chunk.num_rows if chunk.num_rows else 0.0


# -- eviction --------------------------------------------------------------------


def pick_victims(
    oldest_by_tenant: Mapping[bytes, Iterable[tuple[int, int]]],
    size_of: Callable[[int], int],
    excess: int,
    young_after_ns: int,
    usage: Mapping[bytes, int],
    shares: Mapping[bytes, int],
    committer: bytes | None = None,
) -> tuple[list[int], bool]:
    """Chunk ids to evict so that ``excess`` bytes go (docs/decisions/0067).

    The victims are the oldest chunks of the tenants over their share, taken
    in LRU order across those tenants; a tenant stops giving chunks once it
    is down to its share. Only then, when that did not free enough, does the
    committing tenant give its own oldest chunks, under its share or not: a
    tenant's saves may push out its own blocks, never those of a tenant under
    its share. Without shares every tenant's share is 0: plain LRU.

    Args:
        oldest_by_tenant: per tenant, ``(last access ns, chunk id)`` oldest
            first, consumed lazily (the index passes one cursor per tenant: a
            commit that needs one victim reads one entry of each tenant over
            its share). Pinned chunks are not in it.
        size_of: a chunk's size in bytes.
        excess: bytes to free; <= 0 needs no victim.
        young_after_ns: chunks used after this instant are spared (the grace
            period: a scheduler may have just counted them as a hit).
        usage: each tenant's bytes now (the ledger).
        shares: each tenant's share in bytes; absent: 0.
        committer: the tenant whose commit needs the room (None: the
            maintenance job's eviction to a target, which takes from tenants
            over their share only).

    Returns:
        The victims, and whether they cover ``excess`` (a commit that is not
        covered is refused rather than evict hot or reserved data).
    """
    victims: list[int] = []
    if excess <= 0:
        return victims, True
    left = dict(usage)
    cursors = {t: iter(entries) for t, entries in oldest_by_tenant.items()}
    heads: dict[bytes, tuple[int, int]] = {}

    def advance(tenant: bytes) -> tuple[int, int] | None:
        head = next(cursors[tenant], None)
        if head is None or head[0] > young_after_ns:  # the rest is younger still
            heads.pop(tenant, None)
            return None
        heads[tenant] = head
        return head

    def over(tenant: bytes) -> bool:
        return left.get(tenant, 0) > shares.get(tenant, 0)

    heap = []
    for tenant in cursors:
        if over(tenant) and (head := advance(tenant)) is not None:
            heap.append((*head, tenant))
    heapq.heapify(heap)
    while heap:
        _, chunk_id, tenant = heapq.heappop(heap)
        if not over(tenant):
            continue  # down to its share: spared from here on (its head kept)
        size = size_of(chunk_id)
        victims.append(chunk_id)
        left[tenant] = left.get(tenant, 0) - size
        excess -= size
        if excess <= 0:
            return victims, True
        if (head := advance(tenant)) is not None:
            heapq.heappush(heap, (*head, tenant))
    if committer is None or committer not in cursors:
        return victims, False
    head = heads.get(committer)
    if head is None and not over(committer):  # never advanced: start it now
        head = advance(committer)
    while head is not None:  # its own saves push out its own oldest blocks
        victims.append(head[1])
        excess -= size_of(head[1])
        if excess <= 0:
            return victims, True
        head = advance(committer)
    return victims, False


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
    their live rows and returns the dead ones' bytes. Pinned chunks are left
    as they are (compaction never moves a pinned block)."""
    return [c for c in chunks if not c.pinned and live_fraction(c) < min_live]


def merge_groups(
    chunks: Sequence[Chunk], target_bytes: int, *, small_below: float = 0.5
) -> list[list[Chunk]]:
    """Groups of chunks to rewrite as one, per namespace and tenant (a chunk
    holds one tenant's blocks), each up to about ``target_bytes`` of live
    data. Pinned chunks are left as they are.

    Candidates are the chunks smaller than ``small_below * target_bytes`` (decode
    saves make one small chunk per step; a prompt's save is already large).
    Within a namespace chunks stay in creation order, so the blocks of one
    prompt, saved step after step, stay next to each other in the new file and
    a prefix read walks one file front to back. A group of one chunk is left
    alone unless it has dead rows (rewriting it alone gains nothing else).
    """
    limit = small_below * target_bytes
    by_ns: dict[tuple[bytes, bytes], list[Chunk]] = {}
    for chunk in sorted(chunks, key=lambda c: (c.created_ns, c.chunk_id)):
        if chunk.size_bytes < limit and not chunk.pinned:
            by_ns.setdefault((chunk.namespace, chunk.tenant), []).append(chunk)
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
