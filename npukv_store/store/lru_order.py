"""LRU times that never strand a child: a chunk's last access is strictly below
that of the chunk holding its parent block (docs/decisions/0070).

Runs in: the index's write transactions (:mod:`.index` calls these with its
open transaction and databases; pure LMDB reads, no writes), and the saving
thread (:func:`batch_parents`).

    touch_times()   - the times a touch of ``n`` chunks in chain order gives
    batch_parents() - the parent keys of a save's chunk
    parent_bound()  - the newest LRU time a new chunk may have, below the
                      chunks holding its parents
    lost_parents()  - parents inside a chunk whose rows another chunk won

Eviction takes the oldest chunk of the LRU first, so a parent that is always
newer than its children is never evicted before them: no stored block whose
parent block is gone (a "stranded" child: a lookup stops at the gap, so its
bytes serve nobody). Exceptions: pinned chunks (not in the LRU) and tenant
shares (an over-share tenant's parent can go while another tenant's child
stays; a chunk holds one tenant's blocks, and chains of two tenants meet only
where their salt is the same).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import lmdb

from npukv_store.store.index_rows import CID, LOC_FMT, ChunkRecord


def touch_times(now_ns: int, count: int) -> list[int]:
    """The time of each of ``count`` chunks touched in chain order (parents
    first): the i-th gets ``now + (count - 1 - i)`` ns, so a parent touched
    with its children stays newer than each of them."""
    return [now_ns + count - 1 - i for i in range(count)]


def parent_bound(
    txn: lmdb.Transaction,
    keys_db: lmdb._Database,
    chunks_db: lmdb._Database,
    record: ChunkRecord,
    parents: Iterable[bytes],
) -> tuple[int | None, bool]:
    """The newest LRU time ``record`` may take: 1 ns below the oldest
    unpinned chunk holding one of ``parents`` (the keys of the blocks before
    its rows' runs), or None when no such chunk is stored; and whether a
    parent is not stored at all (the chunk would be stranded at birth).
    A parent among ``record``'s own rows (a batch of several chains)
    imposes nothing unless another chunk holds it."""
    bound: int | None = None
    own = set(record.keys)
    for key in parents:
        home = txn.get(key, db=keys_db)
        if home is None:
            if key in own:
                continue  # a row of this chunk: it comes with it
            return bound, True
        chunk_id = LOC_FMT.unpack_from(home)[0]
        if chunk_id == record.chunk_id:
            continue
        raw = txn.get(CID.pack(chunk_id), db=chunks_db)
        if raw is None:
            continue
        parent = ChunkRecord.unpack(chunk_id, raw)
        if parent.pinned:
            continue  # never evicted: it outlives the child anyway
        limit = parent.last_access_ns - 1
        bound = limit if bound is None else min(bound, limit)
    return bound, False


def lost_parents(
    txn: lmdb.Transaction, keys_db: lmdb._Database, record: ChunkRecord
) -> list[bytes]:
    """Keys of ``record`` whose row another chunk won (stored there since
    the claim) where the next row is this chunk's: that chunk holds the
    parent of a row of ours. One get per row; only called when some row lost."""
    home = [
        (raw := txn.get(key, db=keys_db)) is not None
        and LOC_FMT.unpack_from(raw)[0] == record.chunk_id
        for key in record.keys
    ]
    return [
        record.keys[i]
        for i in range(len(record.keys) - 1)
        if not home[i] and home[i + 1]
    ]


#: a save's parent: the key of the block before its first (None: the first
#: block of a chain), or one such key per chain of a batch of several chains
Parent = bytes | Sequence[bytes] | None


def batch_parents(
    keys: Sequence[bytes],
    fresh: Sequence[int],
    parent: Parent,
    stored: Callable[[list[bytes]], list[bool]],
) -> tuple[bytes, ...]:
    """The parent keys of a chunk that holds ``keys[i]`` for each ``i`` in
    ``fresh`` (the rows a save writes): ``parent`` (as given: the block
    before ``keys[0]``, or each chain's) and, after each row skipped, the key
    before the next row written where it is ``stored`` now. A skipped row
    not stored is being written by another live process: it commits after
    it was claimed, so it will be newer than this chunk anyway, and the
    commit must not take it for a parent that is gone."""
    given: tuple[bytes, ...]
    if parent is None:
        given = ()
    elif isinstance(parent, bytes | bytearray | memoryview):
        given = (bytes(parent),)
    else:
        given = tuple(parent)
    gaps = [
        keys[i - 1]
        for j, i in enumerate(fresh)
        if i > 0 and (j == 0 or fresh[j - 1] != i - 1)
    ]
    if gaps:
        gaps = [key for key, held in zip(gaps, stored(gaps), strict=True) if held]
    return given + tuple(gaps)
