"""The publisher: the one way chunks enter and leave the index, for the writer
(``KVStore.put``, the background writer) and for the maintenance job.

Runs in: any process with a store handle; thread-safe.

    claim() / release() - the blocks this process is about to write
    commit()            - publish a chunk file already in place (evicting for room)
    replace()           - compaction: a rewritten chunk takes over old chunks' rows
    evict()             - unpublish the oldest chunks down to a target
    quarantine()        - move corrupt chunks to quarantine/, then unpublish them

Every index change that unpublishes a chunk goes through :meth:`_transact`:
the index transaction commits first, then its single cleanup step unlinks the
files no row points to any more, and their tombstones are dropped in a later
transaction (diskcache's ``_transact`` has the same shape: clean up only what a
committed transaction orphaned). A process killed between the commit and the
unlink leaves a tombstoned file that recovery or ``npukv gc`` removes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

import lmdb

from npukv_store.config import StoreConfig
from npukv_store.keying import DEFAULT_TENANT
from npukv_store.store.admitter import Admitter
from npukv_store.store.claims import ClaimTable
from npukv_store.store.deferred import DEFERRED_SHARE, DeferredUnlinks
from npukv_store.store.directory import CacheDir
from npukv_store.store.dirfd import UnsafeEntry
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord
from npukv_store.store.stats import PutResult, StoreCounters

logger = logging.getLogger(__name__)


class Publisher:
    """Claims, commits and unpublishes for one process's handle on a directory."""

    def __init__(
        self,
        cdir: CacheDir,
        index: Index,
        claims: ClaimTable,
        config: StoreConfig,
        counters: StoreCounters,
        *,
        shares: dict[bytes, int] | None = None,
    ) -> None:
        self.dir = cdir
        #: tenant -> bytes of capacity reserved for it (config.tenant_shares)
        self.shares = shares or {}
        self.index = index
        self.claims = claims
        self.config = config
        self.counters = counters
        self._lock = threading.Lock()
        self._unlinked: list[int] = []  # files we removed: tombstones to drop
        #: young victims' files, unlinked once their grace is over (0070)
        self.deferred = DeferredUnlinks(
            int(config.evict_grace_s * 1e9), int(config.capacity * DEFERRED_SHARE)
        )
        #: which blocks of a save are written (None: all; the store sets it)
        self.admitter: Admitter | None = None

    # -- claims ------------------------------------------------------------------

    def claim(self, keys: Sequence[bytes], tenant: bytes = DEFAULT_TENANT) -> list[int]:
        """Indices of the ``keys`` to write: not stored, admitted (the
        leading run the :attr:`admitter` takes: docs/decisions/0069), and
        claimed now by this process (not held by another live writer, nor
        twice in ``keys``)."""
        locations = self.index.locate(keys)
        absent = [i for i, loc in enumerate(locations) if loc is None]
        if absent and self.admitter is not None:
            run = self.admitter.admit([keys[i] for i in absent], tenant)
            if run < len(absent):
                self.counters.add(declined_blocks=len(absent) - run)
                absent = absent[:run]
        if not absent:
            return []
        try:
            won = self.claims.claim([keys[i] for i in absent])
        except lmdb.Error as exc:  # the disk is full, mostly: as a write would fail
            raise _as_oserror(exc, self.claims.path) from None
        fresh = [i for i, w in zip(absent, won, strict=True) if w]
        if not fresh:
            return []
        # A writer commits, then releases: if its release came between our
        # locate and our claim, its rows are visible now. Look again.
        again = self.index.locate([keys[i] for i in fresh])
        stored = [keys[i] for i, loc in zip(fresh, again, strict=True) if loc]
        if stored:
            self.claims.release(stored)
            fresh = [i for i, loc in zip(fresh, again, strict=True) if loc is None]
        return fresh

    def release(self, keys: Sequence[bytes]) -> None:
        """Drop this process's claims on ``keys`` (after the commit, or a drop)."""
        try:
            self.claims.release(keys)
        except Exception as exc:  # a lease: it expires at its deadline anyway
            logger.warning("could not release %d save claims: %s", len(keys), exc)

    # -- publishing --------------------------------------------------------------

    def commit(
        self,
        record: ChunkRecord,
        path: str,
        *,
        touched: Iterable[bytes] = (),
        skipped: int = 0,
        parents: Sequence[bytes] = (),
    ) -> PutResult:
        """Publish the chunk file at ``path`` (already renamed into place):
        index rows for its keys, evicting for room; the file is deleted when it
        won no row or was rejected. ``skipped`` rows were dropped before the
        write (counted with the rows that lost). ``parents``: the keys of the
        blocks before its rows' runs (its LRU time goes below theirs); the
        files of victims used within ``evict_grace_s`` wait (:mod:`.deferred`)."""
        self.sweep_deferred()
        try:
            with self._transact() as doomed, _lmdb_errors(self.index.path):
                if self.admitter is not None:
                    self.admitter.note_written(record.size_bytes, record.tenant)
                result = self.index.commit_chunk(
                    record,
                    capacity_bytes=self.config.capacity,
                    shares=self.shares,
                    touched=touched,
                    unlinked=self.take_unlinked(),
                    parents=parents,
                    in_txn=None if self.admitter is None else self.admitter.in_txn(),
                )
                doomed.extend(self.deferred.split(result.victims))
        except BaseException:
            unlink_quietly(self.dir, path)
            raise
        if result.rejected or result.live_rows == 0:
            unlink_quietly(self.dir, path)  # published nothing: no row points at it
        keys = len(record.keys)
        stored = result.live_rows
        rejected = keys if result.rejected else 0
        self.counters.add(
            puts=1,
            put_blocks=stored,
            put_bytes=record.size_bytes if stored else 0,
            skipped_blocks=skipped + keys - stored - rejected,
            rejected_blocks=rejected,
            evicted_chunks=len(result.victims),
        )
        return PutResult(
            stored=stored, skipped=keys - stored - rejected + skipped, rejected=rejected
        )

    def replace(
        self,
        record: ChunkRecord,
        path: str,
        sources: Sequence[tuple[int, int]],
        old_ids: Sequence[int],
    ) -> tuple[int, list[ChunkRecord]]:
        """Compaction's commit (see :meth:`Index.replace_chunks`): the new chunk
        is published and the old ones unpublished in one transaction; the old
        files are unlinked after it. Returns the rows won and the old records."""
        try:
            with self._transact() as doomed:
                live, removed = self.index.replace_chunks(record, sources, old_ids)
                doomed.extend(removed)
        except BaseException:
            unlink_quietly(self.dir, path)
            raise
        if live == 0:
            unlink_quietly(self.dir, path)
        return live, removed

    def evict(self, excess: int) -> list[ChunkRecord]:
        """Unpublish the oldest chunks, outside the grace period, until
        ``excess`` bytes are gone (or nothing old enough is left)."""
        if excess <= 0:
            return []
        young_after = time.time_ns() - int(self.config.evict_grace_s * 1e9)
        with self._transact() as doomed:
            victims = self.index.evict(
                excess,
                young_after_ns=young_after,
                in_txn=None if self.admitter is None else self.admitter.in_txn(),
            )
            doomed.extend(victims)
        self.counters.add(evicted_chunks=len(victims))
        return victims

    def drop_missing(self, chunk_ids: Iterable[int]) -> list[ChunkRecord]:
        """Unpublish chunks whose file a reader did not find, if the index still
        has them and the file is still gone (eviction unpublishes before it
        unlinks, so that is a file deleted under the index). Without this,
        their blocks would be claimed by every lookup, missed by every load,
        and never saved again."""
        gone = [
            record.chunk_id
            for record in map(self.index.chunk, chunk_ids)
            if record is not None
            and self.dir.lstat(
                self.dir.chunk_path(record.namespace.hex(), record.chunk_id)
            )
            is None
        ]
        if not gone:
            return []
        try:
            removed = self.index.remove_chunks(gone)
        except Exception as exc:
            logger.warning("could not unpublish chunks with no file: %s", exc)
            return []
        with self._lock:  # no file to unlink: the tombstones can go
            self._unlinked.extend(r.chunk_id for r in removed)
        for record in removed:
            logger.warning(
                "chunk %016x has no file: unpublished, its %d blocks will be "
                "saved again",
                record.chunk_id,
                record.num_rows,
            )
        return removed

    def quarantine(self, chunk_ids: Iterable[int]) -> list[ChunkRecord]:
        """Move corrupt chunks to ``quarantine/`` and unpublish them: their
        blocks become misses (saved again when recomputed) and the files stay
        for an operator to look at, never deleted silently.

        The file moves first: a reader holding its location then misses, and a
        kill before the index commit leaves rows whose file is gone, which read
        as misses until ``npukv verify --fix`` drops them.
        """
        chunk_ids = list(chunk_ids)
        records = [r for r in map(self.index.chunk, chunk_ids) if r is not None]
        for record in records:
            self._move_to_quarantine(record)
        try:
            removed = self.index.remove_chunks(r.chunk_id for r in records)
        except Exception as exc:
            logger.warning("could not unpublish corrupt chunks: %s", exc)
            return []
        with self._lock:  # files gone: their tombstones go next transaction
            self._unlinked.extend(r.chunk_id for r in removed)
        for record in removed:
            logger.warning(
                "chunk %016x is corrupt: moved to %s, its %d blocks will be "
                "saved again",
                record.chunk_id,
                self.dir.quarantine_dir,
                record.num_rows,
            )
        self.counters.add(quarantined_chunks=len(removed))
        return removed

    def _move_to_quarantine(self, record: ChunkRecord) -> None:
        """Relative to the root's fd: a ``quarantine`` that is a symlink (or
        someone else's) is refused, and the chunk deleted instead; a chunk
        file that is a symlink moves itself, its target untouched."""
        source = self.dir.chunk_path(record.namespace.hex(), record.chunk_id)
        target = os.path.join(
            "quarantine", f"{record.namespace.hex()}-{record.chunk_id:016x}.safetensors"
        )
        try:
            self.dir.make_dir("quarantine")
            self.dir.rename(source, target)
        except FileNotFoundError:
            pass  # gone already (evicted, or another process moved it)
        except OSError as exc:  # UnsafeEntry included
            logger.warning("could not quarantine %s (%s); deleting it", source, exc)
            unlink_quietly(self.dir, source)

    # -- the after-commit step ------------------------------------------------------

    @contextlib.contextmanager
    def _transact(self) -> Iterator[list[ChunkRecord]]:
        """Collect the records a transaction unpublishes; once it committed
        (the body returned), unlink their files and queue their tombstones.
        Nothing is unlinked when the body raises: nothing was committed."""
        doomed: list[ChunkRecord] = []
        yield doomed
        for record in doomed:
            unlink_quietly(
                self.dir, self.dir.chunk_path(record.namespace.hex(), record.chunk_id)
            )
        with self._lock:
            self._unlinked.extend(record.chunk_id for record in doomed)

    def sweep_deferred(self, *, everything: bool = False) -> int:
        """Unlink the deferred files whose grace is over (``everything``: all
        of them); their tombstones go in the next transaction. Returns how
        many."""
        records = self.deferred.due(everything=everything)
        if records:
            with self._transact() as doomed:
                doomed.extend(records)
        return len(records)

    def take_unlinked(self) -> list[int]:
        """Chunk ids whose files this process removed since the last call."""
        with self._lock:
            unlinked, self._unlinked = self._unlinked, []
        return unlinked

    def forget_unlinked(self) -> None:
        """Unlink every deferred file and drop the tombstones of files removed
        (at close: no commit follows)."""
        self.sweep_deferred(everything=True)
        unlinked = self.take_unlinked()
        if unlinked:
            self.index.forget_dead(unlinked)


def unlink_quietly(cdir: CacheDir, path: str) -> None:
    """Remove the cache's file ``path`` (relative to its root fd, never
    through a symlink); already gone is the same outcome, and so is a
    directory on the way that is a symlink or someone else's (nothing of
    ours to remove there: logged). A function of its own: the fault tests
    kill the job here (tests/faults)."""
    try:
        cdir.unlink_quietly(path)
    except UnsafeEntry as exc:
        logger.warning("not removing %s: %s", path, exc)


@contextlib.contextmanager
def _lmdb_errors(path: str) -> Iterator[None]:
    """LMDB's own errors as the OSError callers are documented to get."""
    try:
        yield
    except lmdb.Error as exc:
        raise _as_oserror(exc, path) from None


def _as_oserror(exc: lmdb.Error, path: str) -> OSError:
    """An OSError for an LMDB failure: ENOSPC for a full disk or map, else EIO,
    naming the environment and LMDB's reason."""
    full = isinstance(exc, lmdb.DiskError | lmdb.MapFullError) or "No space" in str(exc)
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, f"{os.strerror(code)}: LMDB {path}: {exc}")
