"""Recovery: make a cache directory consistent after any crash, and rebuild the index,
at a cost that does not grow with the store when nothing crashed.

Runs in: a process opening a store, the maintenance job and ``npukv rebuild-index``.

    open_index()      - open the index (shared lock); rebuild it when missing or
                        unreadable, or finish a rebuild whose process died
    rebuild_index()   - a fresh index from the chunk files' own metadata, committed
                        in batches: opens serve from it while it fills
    (sessions: :func:`.sessions.begin_session` tells an open whether a process
    died without closing; then, and only then, the open calls remove_garbage)
    remove_garbage()  - tmp/ files of dead writers, and orphan chunk files

What a crash can leave, by the publish order (tmp write -> fsync -> rename ->
index commit; delete: index commit -> unlink):
    killed before rename   a tmp/<pid>-*.tmp file: garbage once the pid is dead
    killed before commit   a chunk file no index row points to: an orphan
    killed before unlink   an evicted chunk's file: an orphan with a tombstone
Neither is ever visible to readers, who only find chunks through the index.
Only a process that had the store open can leave them, so an open scans only
when a session record's process is gone (docs/decisions/0059); the maintenance
job (``npukv gc``) scans always.

The meta record of the index this module writes (docs/format.md section 5):
    rebuild                "<byte> <pid>@<host>": a rebuild is filling this index;
                           its process holds that byte of .lock. While it exists
                           no chunk file is an orphan (it may be next in line)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass

from npukv_store.errors import FormatError
from npukv_store.keying import DEFAULT_TENANT, TENANT_BYTES
from npukv_store.store.directory import HOST, CacheDir, creator_alive
from npukv_store.store.dirfd import UnsafeEntry
from npukv_store.store.format import META_CREATED_NS, META_CREATOR, META_TENANT
from npukv_store.store.format_checks import parse_header
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord
from npukv_store.store.locks import (
    MAX_SLOTS,
    REBUILD_BYTES,
    byte_locked,
    lock_byte,
    open_lock_file,
    shared_lock,
)

logger = logging.getLogger(__name__)

REBUILD_MARK = b"rebuild"
#: Chunks per rebuild transaction: a synced commit (about 0.5-1 ms) then
#: costs about 1-2 µs per chunk, against 240 µs to read its header.
REBUILD_BATCH = 1024


@dataclass(frozen=True, slots=True)
class OrphanScan:
    """Chunk files no index row points to, split by whether they may be deleted."""

    removable: list[str]
    in_flight: list[str]


def open_index(cdir: CacheDir, *, map_size: int, sync: bool) -> Index:
    """Open the directory's index; rebuild it when missing or unreadable, and
    finish a rebuild whose process died. Call without the directory lock.

    Raises:
        UnsafeEntry: ``index/`` or its files are symlinks or someone else's.
        ConfigError: the directory lock stayed held for ``lock_timeout_s``.
    """
    return open_index_reporting(cdir, map_size=map_size, sync=sync)[0]


def open_index_reporting(
    cdir: CacheDir, *, map_size: int, sync: bool
) -> tuple[Index, bool]:
    """:func:`open_index`, and whether this call rebuilt (part of) it.

    The common case takes ``.lock`` shared, so opens run side by side; only
    a rebuild's start (or a takeover) holds it exclusive, for a rename and a
    few records. The rebuild's batches run without it: other processes open
    meanwhile and serve what is already committed (all of it right: a
    published chunk is a whole, valid file).
    """
    with shared_lock(cdir, cdir.lock_timeout_s) as fd:
        index = _open_existing(cdir, map_size, sync)
        if index is not None and not _abandoned_rebuild(index, fd):
            return index, False
        if index is not None:
            index.close()
    with cdir.locked():  # one process starts (or takes over) a rebuild
        index = _open_existing(cdir, map_size, sync)
        if index is None:
            if cdir.namespaces():
                logger.warning(
                    "index %s missing or unreadable; rebuilding", cdir.index_path
                )
            job = _start_fresh(cdir, map_size, sync)
            index = job.index
        else:
            taken = _take_over(cdir, index)
            if taken is None:
                return index, False  # complete, or a live process fills it
            job = taken
    job.run(cdir)
    return index, True


def rebuild_index(cdir: CacheDir, *, map_size: int, sync: bool) -> Index:
    """Replace the index with one rebuilt from every valid chunk file.

    Chunks are re-published oldest first, so first-commit-wins picks the same
    home for a key as the original commits did, in batches of
    ``REBUILD_BATCH`` per transaction. Unparsable chunk files are deleted; they
    can only come from a torn disk (a rename publishes whole files). Capacity
    is not enforced here; the next put evicts down to it. Killed midway, what
    it committed stays, and the next open (or rebuild) finishes the job.
    Call without the directory lock.

    Raises:
        UnsafeEntry: ``index`` is a symlink or someone else's (never renamed
            or removed: an operator must look at it).
    """
    with cdir.locked():
        job = _start_fresh(cdir, map_size, sync)
    job.run(cdir)
    return job.index


@dataclass
class _Rebuild:
    """A rebuild this process owns: the index it fills, and the descriptor of
    ``.lock`` whose byte says it is alive."""

    index: Index
    fd: int
    mark: bytes

    def run(self, cdir: CacheDir) -> None:
        try:
            records = []
            for namespace in cdir.namespaces():
                for chunk_id, path in cdir.chunk_files(namespace).items():
                    record = _record_from_file(cdir, namespace, chunk_id, path)
                    if record is not None:
                        records.append(record)
            records.sort(key=lambda r: r.created_ns)
            published = 0
            for at in range(0, len(records), REBUILD_BATCH):
                published += self.index.commit_rebuilt(records[at : at + REBUILD_BATCH])
            self.index.forget_meta({REBUILD_MARK: self.mark})
            logger.info(
                "rebuilt index %s: %d of %d chunk files published by this run",
                cdir.index_path, published, len(records),
            )  # fmt: skip
        finally:
            os.close(self.fd)


def _open_existing(cdir: CacheDir, map_size: int, sync: bool) -> Index | None:
    """The index, or None when it is missing or unreadable (never created
    here: an empty index beside chunk files would make them all orphans)."""
    if cdir.lstat(os.path.join("index", "data.mdb")) is None:
        return None
    try:
        return Index(cdir.index_path, map_size=map_size, sync=sync, access=cdir.access)
    except FormatError as exc:
        logger.warning("index unreadable (%s)", exc)
        return None


def _rebuilder_byte(mark: bytes | None) -> int | None:
    """The .lock byte a rebuild mark names (untrusted: None if unusable)."""
    if mark is None:
        return None
    head = mark.split(b" ", 1)[0]
    if not (head.isdigit() and len(head) <= 20):
        return None
    byte = int(head)
    return byte if REBUILD_BYTES <= byte < REBUILD_BYTES + MAX_SLOTS else None


def _abandoned_rebuild(index: Index, fd: int) -> bool:
    """Whether the index carries a rebuild mark no live process holds."""
    mark = index.meta_records(REBUILD_MARK).get(REBUILD_MARK)
    if mark is None:
        return False
    byte = _rebuilder_byte(mark)
    return byte is None or not byte_locked(fd, byte)


def _claim_rebuild(cdir: CacheDir) -> tuple[int, bytes]:
    """A descriptor of .lock holding a free rebuild byte, and the mark naming it."""
    fd = open_lock_file(cdir, ".lock")
    for byte in range(REBUILD_BYTES, REBUILD_BYTES + MAX_SLOTS):
        if lock_byte(fd, byte):
            return fd, f"{byte} {os.getpid()}@{HOST}".encode()
    os.close(fd)
    raise OSError(f"{cdir.full('.lock')}: no free rebuild byte")  # 2**20 rebuilders


def _take_over(cdir: CacheDir, index: Index) -> _Rebuild | None:
    """Under the exclusive lock: own the index's rebuild if its process died."""
    fd = open_lock_file(cdir, ".lock")
    try:
        abandoned = _abandoned_rebuild(index, fd)
    finally:
        os.close(fd)
    if not abandoned:
        return None
    logger.warning(
        "finishing the rebuild of %s that a dead process began", cdir.index_path
    )
    fd, mark = _claim_rebuild(cdir)
    index.add_meta(REBUILD_MARK, mark, overwrite=True)  # one write: never unmarked
    return _Rebuild(index, fd, mark)


def _start_fresh(cdir: CacheDir, map_size: int, sync: bool) -> _Rebuild:
    """Under the exclusive lock: an empty index that carries a rebuild mark
    from its first moment at ``index/`` (made aside, marked, renamed in), so
    no process ever takes it for a complete one."""
    cdir.check_entries(("index",), ())
    for name in cdir.listdir(""):
        if name.startswith(("index.broken-", "index.new-")):
            # left by a process killed here; we hold the lock, so nobody's now.
            # rmtree never follows a symlink (a link itself is left as it is)
            shutil.rmtree(cdir.full(name), ignore_errors=True)
    broken, new = f"index.broken-{os.getpid()}", f"index.new-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        cdir.rename("index", broken)
        shutil.rmtree(cdir.full(broken), ignore_errors=True)
    fd, mark = _claim_rebuild(cdir)
    try:
        fresh = Index(cdir.full(new), map_size=map_size, sync=sync, access=cdir.access)
        try:
            fresh.add_meta(REBUILD_MARK, mark)
        finally:
            fresh.close()
        cdir.rename(new, "index")
        if sync:
            cdir.sync_dir()  # else a power cut loses the name (0071)
        index = Index(cdir.index_path, map_size=map_size, sync=sync, access=cdir.access)
    except BaseException:
        os.close(fd)
        raise
    return _Rebuild(index, fd, mark)


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
    tenant = _tenant_of(header.metadata.get(META_TENANT))
    if tenant is None:
        logger.warning("deleting chunk %s: its tenant is not 16 hex digits", path)
        cdir.unlink_quietly(path)
        return None
    return ChunkRecord(
        chunk_id=chunk_id,
        namespace=bytes.fromhex(namespace),
        size_bytes=header.file_size,
        num_rows=header.num_blocks,
        live_rows=header.num_blocks,
        last_access_ns=min(created, now) if created > 0 else now,
        created_ns=created,
        keys=header.keys,
        tenant=tenant,
    )


def _tenant_of(text: str | None) -> bytes | None:
    """The tenant a chunk header names (absent: the default tenant); None
    for a garbled one."""
    if text is None:
        return DEFAULT_TENANT
    try:
        tenant = bytes.fromhex(text)
    except ValueError:
        return None
    return tenant if len(tenant) == TENANT_BYTES else None


def scan_orphans(cdir: CacheDir, index: Index, max_age_s: float) -> OrphanScan:
    """Chunk files without an index record.

    Removable: a tombstoned one (evicted; its unlinker died before the unlink),
    and one whose creator is dead or that is older than ``max_age_s`` (nobody can
    commit it any more). One whose creator lives may be between its rename and
    its commit: in flight. None is removable while a rebuild fills the index
    (a file it has not reached yet is no orphan). Reads chunk ids only, never
    a whole record.
    """
    published = index.chunk_ids_unless(REBUILD_MARK)
    if published is None:
        logger.info("a rebuild is filling %s: no orphan removed", cdir.index_path)
        return OrphanScan([], [])
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
    # orphan: look again (with the rebuild mark, in one snapshot) before
    # anyone deletes it.
    again = index.chunk_ids_unless(REBUILD_MARK)
    if again is None:
        return OrphanScan([], in_flight)
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
