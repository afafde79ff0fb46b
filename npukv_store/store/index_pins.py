"""Pinned keys in the index: which block keys a pin holds, and the chunks
they keep out of eviction (docs/decisions/0067).

Runs in: any process, inside one of :class:`~.index.Index`'s write
transactions (these functions never open one).

The ``pins`` database holds each (key, pin) pair twice, so that both
questions take one B-tree range:

    b"k" key(16) pin(8) -> ''   is this key pinned?   (a commit's question)
    b"p" pin(8) key(16) -> ''   which keys has a pin?  (an unpin's question)

A key may be pinned before any chunk holds it (a server applies a pin to a
prompt's keys when it first sees the prompt). A chunk is pinned while one of
its home keys is: its record has the PINNED flag and it has no entry in the
lru database, so eviction never meets it and a walk of the LRU never skips
it. Pin records (what the operator pinned) are meta records ``pin/<id>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import lmdb

from npukv_store.store.index_rows import CID, LOC_FMT, ChunkRecord, prefixed

KEY_SIDE = b"k"
PIN_SIDE = b"p"
PIN_RECORD = b"pin/"  # meta: pin/<8-byte id> -> the pin's JSON (store.pins)


def key_is_pinned(cursor: lmdb.Cursor, key: bytes) -> bool:
    """Whether a pin holds ``key`` (``cursor`` on the pins db)."""
    prefix = KEY_SIDE + key
    return bool(cursor.set_range(prefix)) and bytes(cursor.key()).startswith(prefix)


def any_pinned(
    txn: lmdb.Transaction, pins: lmdb._Database, keys: Iterable[bytes]
) -> bool:
    """Whether a pin holds any of ``keys`` (False at once where nothing is
    pinned: a commit then pays one stat call)."""
    if not txn.stat(pins)["entries"]:
        return False
    cursor = txn.cursor(db=pins)
    return any(key_is_pinned(cursor, key) for key in keys)


def pin_keys(
    txn: lmdb.Transaction,
    dbs: PinDbs,
    pin_id: bytes,
    keys: Sequence[bytes],
) -> list[ChunkRecord]:
    """Pin ``keys`` under ``pin_id``; the published chunks that became pinned
    (their lru entries removed). Keys not stored yet are pinned for the
    commit that stores them."""
    chunk_ids: set[int] = set()
    for key in keys:
        txn.put(KEY_SIDE + key + pin_id, b"", db=dbs.pins)
        txn.put(PIN_SIDE + pin_id + key, b"", db=dbs.pins)
        home = txn.get(key, db=dbs.keys)
        if home is not None:
            chunk_ids.add(LOC_FMT.unpack_from(home)[0])
    found = (_published(txn, dbs, chunk_id) for chunk_id in chunk_ids)
    return [_mark(txn, dbs, r, True) for r in found if r is not None and not r.pinned]


def unpin(txn: lmdb.Transaction, dbs: PinDbs, pin_id: bytes) -> list[ChunkRecord]:
    """Drop ``pin_id``'s keys; the chunks no pin holds any more (back in the
    LRU at their last access)."""
    prefix = PIN_SIDE + pin_id
    cursor = txn.cursor(db=dbs.pins)
    keys: list[bytes] = []
    if cursor.set_range(prefix):
        while bytes(cursor.key()).startswith(prefix):
            keys.append(bytes(cursor.key())[len(prefix) :])
            if not cursor.delete():  # delete moves to the next entry
                break
    released: set[int] = set()
    for key in keys:
        txn.delete(KEY_SIDE + key + pin_id, db=dbs.pins)
        if key_is_pinned(cursor, key):
            continue  # another pin holds it
        home = txn.get(key, db=dbs.keys)
        if home is not None:
            released.add(LOC_FMT.unpack_from(home)[0])
    found = (_published(txn, dbs, chunk_id) for chunk_id in released)
    return [
        _mark(txn, dbs, r, False)
        for r in found
        if r is not None and r.pinned and not _holds_pinned(txn, dbs, r, cursor)
    ]


def _published(txn: lmdb.Transaction, dbs: PinDbs, chunk_id: int) -> ChunkRecord | None:
    raw = txn.get(CID.pack(chunk_id), db=dbs.chunks)
    return None if raw is None else ChunkRecord.unpack(chunk_id, raw)


def _mark(
    txn: lmdb.Transaction, dbs: PinDbs, record: ChunkRecord, pinned: bool
) -> ChunkRecord:
    """``record`` pinned (out of the LRU) or not (back in it, at its last
    access)."""
    if pinned:
        txn.delete(record.lru_key, db=dbs.lru)
    else:
        txn.put(record.lru_key, b"", db=dbs.lru)
    record = replace(record, pinned=pinned)
    txn.put(CID.pack(record.chunk_id), record.pack(), db=dbs.chunks)
    return record


def _holds_pinned(
    txn: lmdb.Transaction, dbs: PinDbs, record: ChunkRecord, cursor: lmdb.Cursor
) -> bool:
    """Whether a home key of ``record`` is still pinned."""
    for row, key in enumerate(record.keys):
        home = txn.get(key, db=dbs.keys)
        if home is None or LOC_FMT.unpack_from(home) != (record.chunk_id, row):
            continue
        if key_is_pinned(cursor, key):
            return True
    return False


def pinned_key_count(txn: lmdb.Transaction, pins: lmdb._Database, pin_id: bytes) -> int:
    """How many keys ``pin_id`` holds (stored or not)."""
    return sum(1 for _ in prefixed(txn.cursor(db=pins), PIN_SIDE + pin_id))


class PinDbs:
    """The databases pins touch, from the index's handles."""

    __slots__ = ("pins", "keys", "chunks", "lru")

    def __init__(
        self,
        pins: lmdb._Database,
        keys: lmdb._Database,
        chunks: lmdb._Database,
        lru: lmdb._Database,
    ) -> None:
        self.pins, self.keys, self.chunks, self.lru = pins, keys, chunks, lru
