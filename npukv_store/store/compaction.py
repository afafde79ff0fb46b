"""Compaction: rewrite chunks with dead rows, merge small chunks of a namespace.

Runs in: the maintenance job (:mod:`npukv_store.maintenance`), under its lock,
while servers read and write the directory.

    plan()     - the groups of chunks to rewrite, each becoming one chunk
    compact()  - execute the plan: read live rows (verified), write, replace

Which chunks (:mod:`.policy`): those whose live fraction is below ``min_live``,
and runs of small chunks of one namespace (decode saves make one per step),
merged in creation order up to ``chunk_target_size``.

How (the writer's publish order, then :meth:`Publisher.replace`): the live rows
are read through a store handle, so every byte is checksummed on its way; a
chunk with a row that cannot be read whole is left as it is (a corrupt one is
quarantined by the read itself). The new chunk is written to tmp/, fsynced,
renamed into place, and one index transaction moves each row whose home is
still the row it was copied from and unpublishes the old chunks; their files
are unlinked after the commit.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from typing import Protocol

import numpy as np

from npukv_store.config import StoreConfig
from npukv_store.spec import NamespaceSpec
from npukv_store.store import policy
from npukv_store.store.arrays import empty_rows
from npukv_store.store.directory import CacheDir
from npukv_store.store.format import MAX_CHUNK_BLOCKS
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord
from npukv_store.store.publish import Publisher
from npukv_store.store.store import KVStore
from npukv_store.store.write.chunk_file import write_chunk

logger = logging.getLogger(__name__)


class Tally(Protocol):
    """What compaction counts (the maintenance summary)."""

    rewritten: int
    written: int
    quarantined: int


def plan(index: Index, min_live: float, target_bytes: int) -> list[list[ChunkRecord]]:
    """Groups of chunks to rewrite, each into one new chunk: merges of small
    chunks, then every other chunk below ``min_live`` alone."""
    chunks = list(index.iter_chunks())
    groups = policy.merge_groups(chunks, target_bytes)
    merged = {c.chunk_id for group in groups for c in group}
    groups += [
        [c]
        for c in policy.rewrite_candidates(chunks, min_live)
        if c.chunk_id not in merged
    ]
    return [part for group in groups for part in _split_rows(group)]


def _split_rows(group: list[ChunkRecord]) -> list[list[ChunkRecord]]:
    """Keep each new chunk within the format's row limit."""
    out: list[list[ChunkRecord]] = [[]]
    rows = 0
    for chunk in group:
        if out[-1] and rows + chunk.live_rows > MAX_CHUNK_BLOCKS:
            out.append([])
            rows = 0
        out[-1].append(chunk)
        rows += chunk.live_rows
    return out


def compact(
    cdir: CacheDir,
    publisher: Publisher,
    config: StoreConfig,
    min_live: float,
    tally: Tally,
    *,
    dry_run: bool,
    tick: Callable[[str, int], None],
) -> None:
    """Execute :func:`plan`; counts go to ``tally``."""
    groups = plan(publisher.index, min_live, config.chunk_target_size)
    tick("compact", len(groups))
    stores: dict[bytes, KVStore | None] = {}
    try:
        for group in groups:
            if dry_run:
                tally.rewritten += len(group)
                tally.written += 1
            else:
                namespace = group[0].namespace
                if namespace not in stores:
                    stores[namespace] = _open_namespace(cdir, config, namespace)
                store = stores[namespace]
                if store is not None:
                    _rewrite(store, publisher, group, config, tally)
            tick("", 1)
    finally:
        for store in stores.values():
            if store is not None:
                store.close()


def _open_namespace(
    cdir: CacheDir, config: StoreConfig, namespace: bytes
) -> KVStore | None:
    """A store handle on ``namespace`` for reading its rows; None (skipped, with
    a warning) when its namespace.json is missing or not a spec."""
    path = os.path.join(cdir.ns_dir(namespace.hex()), "namespace.json")
    try:  # never through a symlink (an UnsafeEntry is an OSError too)
        raw = cdir.read_bytes(path, limit=1 << 20)
        spec = NamespaceSpec.from_json(raw.decode("utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning("not compacting namespace %s: %s", namespace.hex(), exc)
        return None
    store = KVStore(config, spec)
    if store.fingerprint != namespace:
        store.close()
        logger.warning("not compacting %s: its namespace.json is another spec", path)
        return None
    return store


def _rewrite(
    store: KVStore,
    publisher: Publisher,
    group: list[ChunkRecord],
    config: StoreConfig,
    tally: Tally,
) -> None:
    """Rewrite ``group``'s live rows as one chunk and replace the group by it."""
    index = publisher.index
    rows_of: list[tuple[int, list[tuple[int, bytes]]]] = []  # chunk -> live rows
    for facts in group:
        record = index.chunk(facts.chunk_id)
        if record is None:
            continue  # evicted since the plan
        homes = index.locate(record.keys)
        live = [
            (row, key)
            for row, (key, home) in enumerate(zip(record.keys, homes, strict=True))
            if home == (record.chunk_id, row)
        ]
        rows_of.append((record.chunk_id, live))
    keys = [key for _, live in rows_of for _, key in live]
    if not keys:
        return
    spec = store.spec
    parts = {f"{lay.name}.{p.name}": p for lay in spec.layers for p in lay.parts}
    out = {name: empty_rows(part, len(keys)) for name, part in parts.items()}
    before = store.counters.snapshot()["quarantined_chunks"]
    ok = store.read_many([(keys, out)], touch=False)[0]
    # A corrupt chunk met on the way was quarantined by the read itself.
    tally.quarantined += store.counters.snapshot()["quarantined_chunks"] - before
    take: list[int] = []  # rows of `keys` that go into the new chunk
    sources: list[tuple[int, int]] = []
    old_ids: list[int] = []
    created: list[int] = []
    position = 0
    for chunk_id, live in rows_of:
        span = range(position, position + len(live))
        position += len(live)
        if not all(ok[i] for i in span):
            continue  # a row could not be read whole: leave this chunk as it is
        take.extend(span)
        sources.extend((chunk_id, row) for row, _ in live)
        old_ids.append(chunk_id)
        created.append(next(c.created_ns for c in group if c.chunk_id == chunk_id))
    if not take:
        return
    new_keys = [keys[i] for i in take]
    rows = {name: np.ascontiguousarray(array[take]) for name, array in out.items()}
    chunk_id = secrets.randbits(63) + 1
    # The oldest source's creation time: a rebuilt index (which re-publishes
    # oldest first) then gives each key the home it has now.
    created_ns = min(created)
    tenant = group[0].tenant  # merge_groups keeps a group to one tenant
    path, size = write_chunk(
        store.dir, spec, store.namespace, chunk_id, new_keys, rows,
        created_ns=created_ns, sync=config.fsync == "chunk", tenant=tenant,
    )  # fmt: skip
    record = ChunkRecord.new(
        chunk_id, store.fingerprint, new_keys, size, created_ns, tenant
    )
    live_rows, removed = publisher.replace(record, path, sources, old_ids)
    tally.rewritten += len(removed)
    tally.written += 1 if live_rows else 0
