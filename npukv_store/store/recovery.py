"""Recovery: make a cache directory consistent after any crash, and rebuild the index.

Runs in: a process opening a store (under the directory lock), the maintenance job
and ``npukv rebuild-index``.

    open_index()       - open the index, rebuilding it when missing or unreadable
    rebuild_index()    - a fresh index from the chunk files' own metadata
    remove_garbage()   - tmp/ files of dead writers, and orphan chunk files

What a crash can leave, by the publish order (tmp write -> fsync -> rename ->
index commit; delete: index commit -> unlink):
    killed before rename   a tmp/<pid>-*.tmp file: garbage once the pid is dead
    killed before commit   a chunk file no index row points to: an orphan
    killed before unlink   an evicted chunk's file: an orphan with a tombstone
Neither is ever visible to readers, who only find chunks through the index.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass

from npukv_store.errors import FormatError
from npukv_store.store.directory import CacheDir, creator_alive
from npukv_store.store.dirfd import UnsafeEntry
from npukv_store.store.format import META_CREATED_NS, META_CREATOR
from npukv_store.store.format_checks import parse_header
from npukv_store.store.index import ChunkRecord, Index

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OrphanScan:
    """Chunk files no index row points to, split by whether they may be deleted."""

    removable: list[str]
    in_flight: list[str]


def open_index(cdir: CacheDir, *, map_size: int, sync: bool) -> Index:
    """Open the directory's index; rebuild it when missing or unreadable.

    Call with ``cdir.locked()`` held so only one process rebuilds.

    Raises:
        UnsafeEntry: ``index/`` or its files are symlinks or someone else's.
    """
    missing = cdir.lstat(os.path.join("index", "data.mdb")) is None
    if not missing:
        try:
            return Index(
                cdir.index_path, map_size=map_size, sync=sync, access=cdir.access
            )
        except FormatError as exc:
            logger.warning("index unreadable (%s); rebuilding it", exc)
    elif cdir.namespaces():
        logger.warning("index %s missing; rebuilding from chunk files", cdir.index_path)
    return rebuild_index(cdir, map_size=map_size, sync=sync)


def rebuild_index(cdir: CacheDir, *, map_size: int, sync: bool) -> Index:
    """Replace the index with one rebuilt from every valid chunk file.

    Chunks are re-published oldest first, so first-commit-wins picks the same
    home for a key as the original commits did. Unparsable chunk files are
    deleted; they can only come from a torn disk (a rename publishes whole files).
    Capacity is not enforced here; the next put evicts down to it.

    Raises:
        UnsafeEntry: ``index`` is a symlink or someone else's (never renamed
            or removed: an operator must look at it).
    """
    broken = f"index.broken-{os.getpid()}"
    cdir.check_entries(("index",), ())
    with contextlib.suppress(FileNotFoundError):
        cdir.rename("index", broken)
        # rmtree never follows a symlink inside; the name is ours alone (pid)
        shutil.rmtree(cdir.full(broken), ignore_errors=True)
    index = Index(cdir.index_path, map_size=map_size, sync=sync, access=cdir.access)
    records = []
    for namespace in cdir.namespaces():
        for chunk_id, path in cdir.chunk_files(namespace).items():
            record = _record_from_file(cdir, namespace, chunk_id, path)
            if record is not None:
                records.append(record)
    records.sort(key=lambda r: r.created_ns)
    for record in records:
        index.commit_chunk(record, capacity_bytes=1 << 62, grace_ns=0)
    logger.info("rebuilt index %s from %d chunk files", cdir.index_path, len(records))
    return index


def _record_from_file(
    cdir: CacheDir, namespace: str, chunk_id: int, path: str
) -> ChunkRecord | None:
    try:
        fd = cdir.open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except UnsafeEntry as exc:  # a symlink: removed itself, never followed
        logger.warning("deleting %s: %s", path, exc)
        cdir.unlink_quietly(path)
        return None
    try:
        header = parse_header(fd, path, namespace=namespace)
    except FormatError as exc:
        logger.warning("deleting unreadable chunk %s: %s", path, exc)
        cdir.unlink_quietly(path)
        return None
    finally:
        os.close(fd)
    now = time.time_ns()
    created = int(header.metadata.get(META_CREATED_NS, "0") or 0)
    return ChunkRecord(
        chunk_id=chunk_id,
        namespace=bytes.fromhex(namespace),
        size_bytes=header.file_size,
        num_rows=header.num_blocks,
        live_rows=header.num_blocks,
        last_access_ns=min(created, now) if created > 0 else now,
        created_ns=created,
        keys=header.keys,
    )


def scan_orphans(cdir: CacheDir, index: Index, max_age_s: float) -> OrphanScan:
    """Chunk files without an index record.

    Removable: a tombstoned one (evicted; its unlinker died before the unlink),
    and one whose creator is dead or that is older than ``max_age_s`` (nobody can
    commit it any more). One whose creator lives may be between its rename and
    its commit: in flight.
    """
    published = {r.chunk_id for r in index.iter_chunks()}
    dead = index.dead_chunks()
    removable, in_flight = [], []
    for namespace in cdir.namespaces():
        for chunk_id, path in cdir.chunk_files(namespace).items():
            if chunk_id in published:
                continue
            if (
                chunk_id in dead
                or cdir.file_age_s(path) > max_age_s
                or not _creator_alive(cdir, path)
            ):
                removable.append(path)
            else:
                in_flight.append(path)
    # A chunk published between our listdir and the index snapshot is not an
    # orphan: look again before anyone deletes it.
    again = {r.chunk_id for r in index.iter_chunks()}
    removable = [p for p in removable if chunk_id_of(p) not in again]
    return OrphanScan(removable, in_flight)


def remove_garbage(cdir: CacheDir, index: Index, max_age_s: float) -> int:
    """Delete tmp/ garbage and removable orphans; returns the number removed."""
    paths = cdir.garbage_tmp(max_age_s) + scan_orphans(cdir, index, max_age_s).removable
    for path in paths:
        cdir.unlink_quietly(path)  # gone: another recoverer was first
    forget_gone_tombstones(cdir, index)
    if paths:
        logger.info("removed %d crash leftovers from %s", len(paths), cdir.root)
    return len(paths)


def forget_gone_tombstones(cdir: CacheDir, index: Index) -> int:
    """Drop the tombstones of unpublished chunks whose files are gone."""
    gone = [
        chunk_id
        for chunk_id, ns in index.dead_chunks().items()
        if cdir.lstat(cdir.chunk_path(ns.hex(), chunk_id)) is None
    ]
    if gone:
        index.forget_dead(gone)
    return len(gone)


def chunk_id_of(path: str) -> int:
    """The chunk id a chunk file's name carries."""
    return int(os.path.basename(path).split(".")[0], 16)


def _creator_alive(cdir: CacheDir, path: str) -> bool:
    try:
        fd = cdir.open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return True  # gone already: nothing to delete
    except UnsafeEntry:
        return False  # a symlink with a chunk's name: nobody publishes that
    try:
        header = parse_header(fd, path)
    except FormatError:
        return False  # nobody publishes an unparsable file
    finally:
        os.close(fd)
    return creator_alive(header.metadata[META_CREATOR])
