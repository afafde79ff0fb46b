"""Bulk-build an index for bench_scale: millions of chunk records in a few
large write transactions, sync off.

``Index.commit_chunk`` is one transaction per chunk (about 50-100 µs each
here, plus an fsync when synced): 1.4 M of them is minutes. This publishes
the same records through the index's own ``_publish_in`` (so what it
writes follows the index's format as that changes), ``STEP`` chunks per
transaction, keys in the random order their values give (as real commits
insert them, so the B-tree's pages fill as they do in use). Unlike
bench/index_fill.py (which builds one index from empty), it grows an index
that already holds chunks, size after size. :func:`check_records` reads the
result back through the public ``Index`` API.

Keys are a pure function of their number (splitmix64), so any process makes
the keys of any chain without the index: chunk ``c`` holds keys ``ROWS * c ..
ROWS * c + ROWS - 1`` (one prompt's blocks saved as consecutive chunks) and
has a random-looking 63-bit id (:func:`chunk_id`), as the store draws its
ids; it was last used at ``c`` ns past the fill's base, so the LRU's oldest
is chunk 0. Chunks carry no data file.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from npukv_store.keying import DEFAULT_TENANT
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord, Ledger

ROWS = 7  # rows per chunk: DeepSeek's count at 64 MiB chunks (scale-review)
CHUNK_BYTES = 64 << 20  # nominal size of a chunk, feeds the ledger only
STEP = 20_000  # chunks per write transaction
NS = bytes(range(16))
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
#: every bulk chunk's last access lies this far before the fill: older than
#: any chunk a measured commit adds, so eviction takes bulk chunks first
_AGE_NS = 10**15


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _MASK


def key_block(start: int, stop: int, salt: int = 0) -> bytes:
    """Keys ``start .. stop-1``, 16 bytes each, concatenated."""
    idx = np.arange(start, stop, dtype=np.uint64) * np.uint64(2) + np.uint64(salt)
    pair = np.stack([_splitmix(idx), _splitmix(idx + np.uint64(1))], axis=1)
    return pair.tobytes()


def keys(start: int, stop: int, salt: int = 0) -> list[bytes]:
    blob = key_block(start, stop, salt)
    return [blob[i : i + 16] for i in range(0, len(blob), 16)]


def chunk_keys(chunk: int) -> list[bytes]:
    """The keys of bulk chunk number ``chunk``."""
    return keys(ROWS * chunk, ROWS * (chunk + 1))


def chunk_ids(start: int, stop: int) -> list[int]:
    """The ids of bulk chunks ``start .. stop-1``: 63-bit, never 0."""
    raw = _splitmix(np.arange(start, stop, dtype=np.uint64) ^ np.uint64(0x5CA1E))
    return [int(x) or 1 for x in (raw >> np.uint64(1)).tolist()]


def chunk_id(chunk: int) -> int:
    return chunk_ids(chunk, chunk + 1)[0]


def fill(
    path: str,
    start_chunk: int,
    stop_chunk: int,
    *,
    namespace: bytes = NS,
    map_size: int = 8 << 30,
) -> float:
    """Add bulk chunks ``start_chunk .. stop_chunk-1`` to the index at
    ``path`` (created if missing); returns the seconds it took."""
    t0 = time.perf_counter()
    index = Index(path, map_size=map_size, sync=False)
    try:
        base_ns = time.time_ns() - _AGE_NS
        for lo in range(start_chunk, stop_chunk, STEP):
            hi = min(lo + STEP, stop_chunk)
            _fill_step(index, lo, hi, namespace, base_ns)
    finally:
        index.close()
    return time.perf_counter() - t0


def _fill_step(index: Index, lo: int, hi: int, ns: bytes, base_ns: int) -> None:
    """One write transaction: chunks ``lo .. hi-1`` published by the index's
    own ``_publish_in`` (what ``commit_chunk`` does for one chunk, without
    eviction; bench/index_fill.py uses it alike), then the ledger."""
    blob = key_block(ROWS * lo, ROWS * hi)
    ids = chunk_ids(lo, hi)
    env: Any = index._env  # no public many-chunk commit: see the docstring
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        for chunk in range(lo, hi):
            off = (chunk - lo) * ROWS * 16
            ks = tuple(blob[off + 16 * r : off + 16 * r + 16] for r in range(ROWS))
            last = base_ns + chunk
            record = ChunkRecord(
                ids[chunk - lo], ns, CHUNK_BYTES, ROWS, 0, last, last, ks
            )
            if index._publish_in(txn, record) != ROWS:
                raise RuntimeError(f"bulk chunk {chunk}: a key was stored already")
        ledger = Ledger(txn, meta)  # the total and each tenant's part
        ledger.add(DEFAULT_TENANT, (hi - lo) * CHUNK_BYTES)
        ledger.write()


def check_records(index: Index, chunks: int, first: int = 0) -> None:
    """The real ``Index`` reads what :func:`fill` wrote: a chunk's record, a
    key's home, a chain's prefix. RuntimeError otherwise (the record format
    of store/index.py changed: this module must follow it)."""
    probe = max(first, chunks // 2)
    cid = chunk_id(probe)
    record = index.chunk(cid)
    ks = chunk_keys(probe)
    if record is None or list(record.keys) != ks or record.live_rows != ROWS:
        raise RuntimeError(f"bulk chunk {probe}: the index reads {record!r}")
    if index.locate(ks[2:3]) != [(cid, 2)]:
        raise RuntimeError("bulk keys: the index locates them elsewhere")
    if index.lookup_prefix([*ks, bytes(16)]) != ROWS:
        raise RuntimeError("bulk keys: the index's prefix lookup disagrees")
