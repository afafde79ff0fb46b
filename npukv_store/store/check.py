"""check_store(): verify every invariant of a cache directory.

Runs in: tests, the maintenance job and ``KVStore.check()``. Read-only unless
``fix`` is set. Meant for a quiescent directory: a publish in flight in another
process is reported as such only when its creator is dead.

Invariants (each violation is one line of the returned list):
 1. the ledger's total equals the sum of the chunk records' sizes, and stays
    within capacity; each tenant's part equals the sum of its records' sizes;
 2. the LRU has exactly one entry per unpinned chunk record, at its last
    access, and a chunk is pinned exactly when a pin holds one of its home keys;
 3. every chunk record has its file, of the recorded size, with a valid header of
    its namespace whose keys and tenant are the record's;
 4. every key row points to a chunk record whose row holds that key, and each
    record's live row count equals the rows that point to it;
 5. no tmp/ file of a dead writer and no removable orphan chunk file remains
    (an evicted chunk's file whose unlink never happened counts as one);
 6. (verify_data) every live row's checksums match its bytes.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from npukv_store.config import StoreConfig
from npukv_store.errors import FormatError
from npukv_store.keying import DEFAULT_TENANT
from npukv_store.store import recovery
from npukv_store.store.directory import CacheDir
from npukv_store.store.dirfd import UnsafeEntry
from npukv_store.store.format import META_TENANT, ChunkHeader, layer_checksums
from npukv_store.store.format_checks import parse_header
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord


def check_store(
    cdir: CacheDir, index: Index, config: StoreConfig, *, verify_data: bool, fix: bool
) -> list[str]:
    """The problems found in ``cdir`` (empty when every invariant holds)."""
    problems: list[str] = []
    records = {r.chunk_id: r for r in index.iter_chunks()}
    total, _, _ = index.totals()
    size_sum = sum(r.size_bytes for r in records.values())
    if total != size_sum:
        problems.append(f"ledger total {total} != sum of chunk sizes {size_sum}")
    if total > config.capacity:
        problems.append(f"total {total} bytes exceeds capacity {config.capacity}")
    by_tenant: Counter[bytes] = Counter()
    for chunk in records.values():
        by_tenant[chunk.tenant] += chunk.size_bytes
    ledger, _ = index.tenants()
    if ledger != {t: n for t, n in by_tenant.items() if n}:
        problems.append(
            f"tenant ledger {_hex(ledger)} != chunk sizes per tenant {_hex(by_tenant)}"
        )
    problems += [f"admission: {p}" for p in index.admission_problems()]
    lru = dict((cid, ns) for ns, cid in index.iter_lru())
    expected_lru = {cid: r.last_access_ns for cid, r in records.items() if not r.pinned}
    if lru != expected_lru:
        problems.append(
            f"LRU has {len(lru)} entries, {len(expected_lru)} unpinned chunk records"
        )
    homes: Counter[int] = Counter()
    pinned_keys = index.pinned_key_set()
    holds_pinned: set[int] = set()
    for key, chunk_id, row in index.iter_keys():
        record = records.get(chunk_id)
        if record is None or row >= record.num_rows or record.keys[row] != key:
            problems.append(
                f"key {key.hex()} points to chunk {chunk_id:016x} row {row}"
            )
        homes[chunk_id] += 1
        if key in pinned_keys:
            holds_pinned.add(chunk_id)
    for chunk_id, record in records.items():
        if record.pinned != (chunk_id in holds_pinned):
            problems.append(
                f"chunk {chunk_id:016x}: pinned {record.pinned}, but a pin holds "
                f"{'one' if chunk_id in holds_pinned else 'none'} of its keys"
            )
    for chunk_id, record in records.items():
        if homes[chunk_id] != record.live_rows:
            problems.append(
                f"chunk {chunk_id:016x}: live_rows {record.live_rows}, "
                f"{homes[chunk_id]} key rows point to it"
            )
        problems.extend(chunk_file_problems(cdir, record, verify_data))
    for chunk_id in index.dead_chunks():
        if chunk_id in records:
            problems.append(f"chunk {chunk_id:016x} is both published and dead")
    problems.extend(_check_leftovers(cdir, index, config, fix))
    return problems


def chunk_file_problems(
    cdir: CacheDir, record: ChunkRecord, verify_data: bool
) -> list[str]:
    """Invariant 3 (and 6 with ``verify_data``) for one chunk: its problems."""
    path = cdir.chunk_path(record.namespace.hex(), record.chunk_id)
    try:
        fd = cdir.open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return [f"chunk {path}: indexed but missing"]
    except UnsafeEntry as exc:  # a symlink in its place: as bad as corrupt
        return [f"chunk {path}: {exc}"]
    try:
        header = parse_header(fd, path, namespace=record.namespace.hex())
        if header.file_size != record.size_bytes or header.keys != record.keys:
            return [f"chunk {path}: size or keys differ from its index record"]
        tenant = header.metadata.get(META_TENANT, DEFAULT_TENANT.hex())
        if tenant != record.tenant.hex():
            return [
                f"chunk {path}: tenant {tenant}, its record's {record.tenant.hex()}"
            ]
        if verify_data:
            return _verify_rows(fd, header)
    except FormatError as exc:
        return [f"chunk {path}: {exc}"]
    finally:
        os.close(fd)
    return []


def _hex(counts: dict[bytes, int]) -> dict[str, int]:
    return {t.hex(): n for t, n in sorted(counts.items())}


def _verify_rows(fd: int, header: ChunkHeader) -> list[str]:
    problems = []
    for li, entries in enumerate(header.layers):
        data = [os.pread(fd, e.end - e.begin, e.begin) for e in entries]
        if any(len(d) != e.end - e.begin for d, e in zip(data, entries, strict=True)):
            return [f"chunk {header.path}: short read of layer {li}"]
        found = layer_checksums(data, header.num_blocks)
        for row in np.nonzero(found != header.checksums[:, li])[0].tolist():
            problems.append(f"chunk {header.path}: row {row} layer {li} checksum")
    return problems


def _check_leftovers(
    cdir: CacheDir, index: Index, config: StoreConfig, fix: bool
) -> list[str]:
    if fix:
        recovery.remove_garbage(cdir, index, config.tmp_max_age_s)
        return []
    garbage = cdir.garbage_tmp(config.tmp_max_age_s)
    orphans = recovery.scan_orphans(cdir, index, config.tmp_max_age_s).removable
    return [f"tmp garbage {p}" for p in garbage] + [
        f"orphan chunk {p}" for p in orphans
    ]
