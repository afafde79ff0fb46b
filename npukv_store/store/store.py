"""KVStore: the on-disk block store facade over chunk files and the shared index.

Runs in: any process; many processes may open the same cache directory at once.
A handle is thread-safe; after fork() it reopens its index in the child.

    put()    - write a batch of blocks as one chunk and publish it
    put_async() / flush() - stage a batch in the shared-memory ring; a
               background writer publishes it (never blocks; full ring: drop)
    lookup() - longest stored prefix of a key chain
    read()   - rows of named tensors (whole blocks or single layers) into buffers
    stats()  - directory-wide and process-local counters
    check()  - verify every invariant (see :mod:`.check`); the tests' oracle

Safety: a chunk is written under tmp/, fsynced (``fsync=chunk``), renamed into
``<ns>/chunks/`` and only then committed to the index, so a reader never sees a
partial chunk. Reads treat any doubt (missing file, short read, bad header, key
or checksum mismatch) as a miss for the affected blocks: the caller recomputes.
What is *not* guaranteed: a lookup hit can turn into a read miss if another
process evicts the chunk in between.

Over 400 lines because it is the package's public class: its methods are
short delegations to :mod:`.publish`, :mod:`.read`, :mod:`.write` and
:mod:`.recovery`, each with the API's documentation.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from npukv_store.config import StoreConfig
from npukv_store.hashing import chain_hashes, chain_root, namespace_fingerprint
from npukv_store.io.ring_sizing import RingRequest
from npukv_store.io.writer import Event
from npukv_store.keying import DEFAULT_TENANT, KeyDomain
from npukv_store.spec import NamespaceSpec
from npukv_store.store import recovery
from npukv_store.store.admission import AdmissionTuning
from npukv_store.store.admitter import Admitter
from npukv_store.store.arrays import input_rows, merge_reads
from npukv_store.store.claims import ClaimTable
from npukv_store.store.directory import CacheDir
from npukv_store.store.index_rows import ChunkRecord, RemovedKeys
from npukv_store.store.lru_order import Parent, batch_parents
from npukv_store.store.page_cache import PageCache
from npukv_store.store.publish import Publisher
from npukv_store.store.read.plan import ChunkReadPlan, ReadTuning
from npukv_store.store.read.reader import ChunkReader
from npukv_store.store.sessions import begin_session
from npukv_store.store.stats import PutResult, StoreCounters, StoreStats
from npukv_store.store.tenants import share_bytes
from npukv_store.store.touches import TouchRecorder
from npukv_store.store.write.chunk_file import write_chunk
from npukv_store.store.write.staging import (
    AsyncSaver,
    RemoteSink,
    SaveTarget,
    StagedSave,
)

logger = logging.getLogger(__name__)


class KVStore:
    """A handle on one namespace of a shared cache directory.

    Args:
        config: the store configuration (``cache_dir``, ``capacity``, ...).
        spec: the namespace (model, layout, rank); it names the chunk directory
            and seeds the block keys.

    Raises:
        ConfigError: cache_dir is unusable.
        FormatError: the directory marker or namespace.json is foreign.
    """

    def __init__(
        self,
        config: StoreConfig,
        spec: NamespaceSpec,
        *,
        read_tuning: ReadTuning | None = None,
        admission_tuning: AdmissionTuning | None = None,
        _parent: KVStore | None = None,
    ) -> None:
        self.config = config
        self.spec = spec
        self._admission_tuning = admission_tuning
        self.fingerprint = namespace_fingerprint(spec)
        self.namespace = self.fingerprint.hex()
        self.dir = CacheDir.for_config(config)
        self.key_domain: KeyDomain | None = (
            None if _parent is None else _parent.key_domain
        )
        self._parent = _parent
        self.counters: StoreCounters = (
            StoreCounters() if _parent is None else _parent.counters
        )
        self._lock = threading.Lock()
        self._async: AsyncSaver | None = None  # ring + writer, on first put_async
        self._reader = ChunkReader(
            self.dir, spec, self.namespace, self.counters,
            verify=config.verify == "always", engine_kind=config.io_engine,
            queue_depth=config.io_queue_depth, direct=config.direct_io,
            tuning=read_tuning,
        )  # fmt: skip
        self.touches = TouchRecorder(lambda: self.index)
        self.page_cache = PageCache(
            self.dir, lambda: self.index, self._reader.tuning.cached_share
        )
        self._closed = threading.Event()
        self._open()

    def _open(self) -> None:
        self._pid = os.getpid()
        self.dir.open()
        if self.key_domain is None:
            self.key_domain = KeyDomain.for_config(
                self.dir.read_secret(),
                remote_store=self.config.remote_store,
                remote_secret_file=self.config.remote_secret_file,
                remote_insecure=self.config.remote_insecure,
            )
        # No step here grows with the store (docs/decisions/0059): the index
        # opens under .lock shared, a record in sessions says we are open, and
        # the directory is scanned for garbage only when a session's process
        # died without closing, the machine restarted since the last open
        # (a power cut may have taken the records: 0072), or a rebuild ran
        # (the scan is then ours alone, outside any lock: other processes
        # open meanwhile).
        self.index, rebuilt = recovery.open_index_reporting(
            self.dir, map_size=self.config.index_map_size, sync=self._sync
        )
        self._session = begin_session(self.dir)
        self.dir.ensure_namespace(self.namespace, self.spec.canonical_json())
        self.claims = ClaimTable(self.dir.claims_path, access=self.dir.access)
        if rebuilt or self._session.must_scan:
            recovery.remove_garbage(self.dir, self.index, self.config.tmp_max_age_s)
        self.publisher = Publisher(
            self.dir, self.index, self.claims, self.config, self.counters,
            shares=share_bytes(self.config, self.key_domain.tenant),
        )  # fmt: skip
        # the flush also unlinks deferred files whose grace is over (0070)
        self.touches.after_flush = self.publisher.sweep_deferred
        self.admitter = Admitter(
            lambda: self.index, self.config, self.spec.block_bytes, self.counters,
            self._admission_tuning,
        )  # fmt: skip
        self.publisher.admitter = self.admitter if self.admitter.active else None
        self.touches.also = self.admitter.due if self.admitter.active else None
        self.admitter.on_decline = self.touches.soon

    @property
    def _sync(self) -> bool:
        return self.config.fsync == "chunk"

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # LMDB handles must not cross fork()
            self._session.drop_after_fork()  # the parent's session stays its own
            self._reader.clear()
            self.touches.reset_after_fork()
            self._async = None  # the parent's ring and writer thread stay its own
            self._open()

    def sibling(self, spec: NamespaceSpec) -> KVStore:
        """A handle on another namespace of the same directory that shares this
        handle's staging ring, writer thread and counters.

        For a process whose KV spans several namespaces (a hybrid model's KV
        cache groups): one ring per process, not one per namespace, so
        ``ring_size`` stays the process's budget. Close siblings before or
        after this handle, in any order.
        """
        return KVStore(self.config, spec, read_tuning=self._reader.tuning, _parent=self)

    def tenant(self, cache_salt: str | None) -> bytes:
        """The tenant of requests with ``cache_salt`` (None: the default one),
        a keyed digest of it (docs/decisions/0067)."""
        assert self.key_domain is not None  # set by _open
        return self.key_domain.tenant(cache_salt)

    def keys_for(
        self, tokens: Sequence[int] | np.ndarray, extra: bytes = b""
    ) -> list[bytes]:
        """Block keys of ``tokens`` in this namespace (full blocks only), on
        the chain its TP rank 0 shares (:func:`~npukv_store.hashing.chain_root`)."""
        assert self.key_domain is not None  # set by _open
        return chain_hashes(
            tokens, self.spec.block_size, self.fingerprint, extra,
            key=self.key_domain.chain_key, root=chain_root(self.spec),
        )  # fmt: skip

    # -- put ------------------------------------------------------------------

    def put(
        self,
        keys: Sequence[bytes],
        tensors: Mapping[str, object],
        *,
        tenant: bytes = DEFAULT_TENANT,
        parent: Parent = None,
    ) -> PutResult:
        """Store a batch of blocks as one chunk.

        Args:
            keys: one 16-byte key per block (row).
            tensors: every tensor name of the namespace -> an array (numpy or CPU
                torch) shaped ``[len(keys), *row_shape]`` of the part's dtype.
            tenant: whose blocks they are (:meth:`tenant`; docs/decisions/0067).
            parent: the key of the block before ``keys[0]`` in its chain (None:
                ``keys[0]`` starts a chain; a batch of several chains passes
                each one's): the chunk goes below its parents in the LRU, so
                eviction never strands it (docs/decisions/0070).

        Returns:
            How many rows were stored, skipped (already stored, or claimed by a
            live process that is writing them: see :mod:`.claims`) or rejected
            for lack of room.

        Raises:
            ValueError: keys or tensors do not match the namespace.
            OSError: the chunk could not be written (nothing is published).
        """
        self._check_fork()
        rows = input_rows(self.spec, keys, tensors)
        fresh = self._claim(keys, tenant)
        try:
            return self._put_claimed(
                keys, rows, fresh, tenant, self._parents(keys, fresh, parent)
            )
        finally:
            self._release_claims([keys[i] for i in fresh])

    def _claim(self, keys: Sequence[bytes], tenant: bytes) -> list[int]:
        """Indices of keys not stored, not being written by a live process
        and admitted (:mod:`.admission`); claims them for this one."""
        return self.publisher.claim(keys, tenant)

    def _parents(
        self, keys: Sequence[bytes], fresh: list[int], parent: Parent
    ) -> tuple[bytes, ...]:
        """The parent keys of the chunk of ``keys[fresh]`` (docs/decisions/0070)."""
        return batch_parents(
            keys,
            fresh,
            parent,
            lambda ks: [loc is not None for loc in self.index.locate(ks)],
        )

    def _put_claimed(
        self,
        keys: Sequence[bytes],
        rows: dict[str, np.ndarray],
        fresh: list[int],
        tenant: bytes,
        parents: tuple[bytes, ...] = (),
    ) -> PutResult:
        skipped = len(keys) - len(fresh)
        if not fresh:
            self.counters.add(skipped_blocks=skipped)
            return PutResult(stored=0, skipped=skipped, rejected=0)
        if len(fresh) < len(keys):
            rows = {name: view[fresh] for name, view in rows.items()}
            keys = [keys[i] for i in fresh]
        chunk_id = secrets.randbits(63) + 1
        created = time.time_ns()
        path, size = write_chunk(
            self.dir, self.spec, self.namespace, chunk_id, keys, rows,
            created_ns=created, sync=self._sync, tenant=tenant,
        )  # fmt: skip
        record = ChunkRecord.new(
            chunk_id, self.fingerprint, keys, size, created, tenant
        )
        return self.publisher.commit(
            record, path, touched=self.touches.take(), skipped=skipped,
            parents=parents,
        )  # fmt: skip

    def put_async(
        self,
        keys: Sequence[bytes],
        tensors: Mapping[str, object],
        event: Event | None = None,
        *,
        tenant: bytes = DEFAULT_TENANT,
        parent: Parent = None,
    ) -> PutResult:
        """Stage a batch of blocks in the shared-memory ring and return at once.

        The background writer publishes it later (see :meth:`flush`). Blocks
        already stored or in flight are skipped; when the ring has no room the
        whole batch is dropped and counted (``dropped``): saving never waits.

        Args:
            keys, tensors, tenant, parent: as for :meth:`put`.
            event: for device callers, what to wait for before the staged bytes
                are complete (a D2H copy into the ring); None on the CPU.

        Returns:
            ``queued``, ``skipped`` and ``dropped`` block counts.
        """
        self._check_fork()
        rows = input_rows(self.spec, keys, tensors)
        try:
            fresh = self._claim(keys, tenant)
        except OSError as exc:  # no room for the claims: the save is dropped
            self._drop_unclaimed(len(keys), exc)
            return PutResult(stored=0, skipped=0, rejected=0, dropped=len(keys))
        try:
            queued = self._saver().stage(
                self._target(), keys, rows, fresh, event, tenant,
                parents=self._parents(keys, fresh, parent),
            )  # fmt: skip
        except BaseException:  # e.g. the ring does not fit: keys must stay savable
            self._release_claims([keys[i] for i in fresh])
            raise
        skipped = len(keys) - len(fresh)
        dropped = len(fresh) - queued
        if dropped:
            self._release_claims([keys[i] for i in fresh])
        self.counters.add(
            skipped_blocks=skipped, queued_blocks=queued, dropped_blocks=dropped
        )
        return PutResult(
            stored=0, skipped=skipped, rejected=0, queued=queued, dropped=dropped
        )

    def begin_save(
        self,
        keys: Sequence[bytes],
        *,
        to_remote: bool = True,
        tenant: bytes = DEFAULT_TENANT,
        parent: Parent = None,
    ) -> StagedSave | None:
        """Claim the blocks of ``keys`` not stored or in flight and reserve a
        ring region laid out as their chunk, for a caller that fills it layer
        by layer (the connector's device copies). Never blocks. ``tenant``
        and ``parent`` as for :meth:`put`.

        Returns:
            None when nothing is left to save or the ring is full (counted as
            skipped or dropped). Otherwise a :class:`StagedSave`: fill every
            layer's rows at ``staged.layer_address(i)``, then
            :meth:`commit_save` or :meth:`abort_save` it exactly once.
        """
        self._check_fork()
        try:
            fresh = self._claim(keys, tenant)
        except OSError as exc:  # no room for the claims: the save is dropped
            self._drop_unclaimed(len(keys), exc)
            return None
        skipped = len(keys) - len(fresh)
        batch_keys = tuple(keys[i] for i in fresh)
        staged = None
        try:
            if fresh:
                staged = self._saver().reserve(
                    self._target(), batch_keys, to_remote=to_remote, tenant=tenant,
                    parents=self._parents(keys, fresh, parent),
                )  # fmt: skip
        finally:
            if staged is None:
                self._release_claims(batch_keys)
        dropped = len(fresh) if staged is None else 0
        self.counters.add(skipped_blocks=skipped, dropped_blocks=dropped)
        if staged is None:
            return None
        return StagedSave(self.spec, staged, fresh)

    def commit_save(self, staged: StagedSave, event: Event | None = None) -> None:
        """Queue a filled :class:`StagedSave` for the writer; it is read only
        after ``event`` (the device copies into it) has fired."""
        self._saver().submit(staged.batch, event)
        self.counters.add(queued_blocks=len(staged.keys))

    def abort_save(self, staged: StagedSave) -> None:
        """Drop a :class:`StagedSave` unwritten and release its blocks."""
        self._saver().abort(staged.batch)
        self._release_claims(staged.keys)
        self.counters.add(dropped_blocks=len(staged.keys))

    def ring_used_bytes(self) -> int:
        """Bytes of the staging ring held by saves not yet published (0 without
        a ring): a gauge for operators, 0 after a flush."""
        if self._parent is not None:
            return self._parent.ring_used_bytes()
        saver = self._async
        return 0 if saver is None else saver.ring.used_bytes

    def attach_remote(self, sink: RemoteSink) -> None:
        """Also write every block this handle's ring publishes to ``sink``
        (the remote tier), from the ring, after the local publish."""
        self._saver().remote = sink

    def ring_buffer(self) -> np.ndarray:
        """The staging ring's bytes (creating it): what a device registers."""
        return self._saver().ring.data

    def readahead(self, keys: Sequence[bytes]) -> int:
        """Hint the kernel to start reading the chunks holding ``keys``.

        Best effort and non-blocking; returns how many chunk files were hinted.
        """
        self._check_fork()
        return self.page_cache.readahead(keys)

    def read_plan(self, chunk_id: int) -> ChunkReadPlan | None:
        """How a read of all of ``chunk_id`` would go now (``npukv inspect
        --plan``): each layer's route and why; None where it cannot be read."""
        self._check_fork()
        return self._reader.plan(chunk_id)

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored in chunk files the page cache
        mostly holds (``ReadTuning.cached_share`` of their pages): the part of a
        hit that loads at memory speed. Stops at the first other key. One
        cachestat (or mincore) per chunk file; never reads data."""
        self._check_fork()
        return self.page_cache.cached_prefix(keys)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything put_async'ed so far is published (visible to
        other processes) or has failed. Returns False on timeout. A sibling
        waits for its parent's ring, every namespace's batches."""
        if self._parent is not None:
            return self._parent.flush(timeout_s)
        return self._async is None or self._async.flush(timeout_s)

    def prepare_async(self, ring_request: RingRequest | None = None) -> None:
        """Create the staging ring and start the writer now (idempotent).

        put_async does it on first use, but creating and pre-faulting the ring
        costs time (about 0.6 s per GiB on vm, the 2-core development VM): a
        serving process calls this at start-up so no forward pass pays for it.
        ``ring_request`` sizes an auto ring (``ring_size: 0``): what the saves
        need (the connector's, from its step; io.ring_sizing).

        Raises:
            ConfigError: ``ring_size`` does not fit in /dev/shm.
        """
        self._saver(ring_request)

    def _saver(self, ring_request: RingRequest | None = None) -> AsyncSaver:
        if self._parent is not None:
            return self._parent._saver(ring_request)
        with self._lock:
            if self._async is None:
                self._async = AsyncSaver(self.config, ring_request=ring_request)
            return self._async

    def _drop_unclaimed(self, count: int, exc: OSError) -> None:
        self.counters.add(dropped_blocks=count, failed_batches=1)
        logger.warning("save of %d blocks dropped: %s", count, exc)

    def _release_claims(self, keys: Sequence[bytes]) -> None:
        self.publisher.release(keys)

    def _target(self) -> SaveTarget:
        """What the writer needs to publish a batch of this namespace."""
        return SaveTarget(self.publisher, self.spec, self.fingerprint, self.touches)

    # -- lookup and read -------------------------------------------------------

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is stored (lookup() for keys that need not form
        a prefix: a sliding-window group stores only the tails a hit needs)."""
        self._check_fork()
        found = [loc is not None for loc in self.index.locate(keys)]
        hits = [key for key, hit in zip(keys, found, strict=True) if hit]
        self.touches.note_keys(hits)
        if self.admitter.note_asked(keys):
            self.touches.wake()
        self.counters.add(lookups=1, hit_blocks=sum(found), lookup_blocks=len(keys))
        return found

    def removed_position(self) -> int:
        """Where a reader of the directory's removal log starts now."""
        return self.index.removed_position()

    def removed_since(self, position: int, limit: int = 256) -> RemovedKeys:
        """The keys that left the directory (evicted, removed, by any process)
        since ``position`` of its removal log (:meth:`.Index.removed_since`)."""
        return self.index.removed_since(position, limit)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are stored (a hit is not a promise:
        the chunk may be evicted before it is read, which reads as a miss)."""
        self._check_fork()
        count = self.index.lookup_prefix(keys)
        if count:
            self.touches.note_keys(keys[:count])
        if self.admitter.note_asked(keys):
            self.touches.wake()
        self.counters.add(lookups=1, hit_blocks=count, lookup_blocks=len(keys))
        return count

    def read(self, keys: Sequence[bytes], out: Mapping[str, object]) -> list[bool]:
        """Read blocks into caller buffers.

        Args:
            keys: the blocks to read.
            out: tensor name -> writable array ``[len(keys), *row_shape]``. The
                names pick the layers read; a layer's parts come all or none.

        Returns:
            Per key, True when every requested layer was read and verified.
            False means a miss: not stored, gone, unreadable or corrupt; the
            row's contents are then unspecified and must be recomputed.
        """
        return self.read_many([(keys, out)])[0]

    def read_many(
        self,
        requests: Sequence[tuple[Sequence[bytes], Mapping[str, object]]],
        *,
        touch: bool = True,
    ) -> list[list[bool]]:
        """``read`` of several ``(keys, out)`` requests in one call: each chunk
        file is read once, its rows in file order whichever request they fill.
        Where a chunk's rows go to separate buffers (vLLM's pages: blocks in
        two runs of ids), separate calls would each walk the file, and a short
        run's small ranges would each wait for the disk (docs/decisions/0052).

        Every request must name the same tensors. Returns ``read``'s list per
        request. A read leaves the chunks' LRU recency as it is: the lookup
        that found the blocks touched their whole prefix in chain order, and a
        read of a chain's tail alone would make a child newer than its parent
        (docs/decisions/0070). ``touch`` is accepted and ignored.
        """
        self._check_fork()
        merged = merge_reads(self.spec, requests)
        if merged is None:
            return []
        all_keys, positions, layers = merged.keys, merged.positions, merged.layers
        ok = [False] * len(all_keys)
        by_chunk: dict[int, list[tuple[int, int]]] = {}
        located = self.index.locate([all_keys[i] for i in positions])
        for i, loc in zip(positions, located, strict=True):
            if loc is not None:
                by_chunk.setdefault(loc[0], []).append((i, loc[1]))
        chunks = list(by_chunk.items())
        results = self._reader.read_chunks(chunks, all_keys, layers, merged.dest)
        for good in results:
            for i in good:
                ok[i] = True
        corrupt = self._reader.take_corrupt()
        if corrupt:
            self._quarantine(corrupt)
        missing = self._reader.take_missing()
        if missing:
            self.publisher.drop_missing(missing)
        hits = sum(ok)
        self.counters.add(
            read_blocks=hits,
            read_misses=len(positions) - hits,
            read_bytes=hits * sum(self.spec.layers[li].row_bytes for li in layers),
        )
        return [
            ok[start : start + len(keys)]
            for start, (keys, _) in zip(merged.starts, requests, strict=True)
        ]

    def _quarantine(self, chunk_ids: set[int]) -> None:
        """Chunks found corrupt: moved to quarantine/ and unpublished; their
        blocks become misses and are saved again when recomputed."""
        self.publisher.quarantine(chunk_ids)

    def flush_touches(self) -> None:
        """Write pending LRU touches to the index now."""
        if os.getpid() == self._pid:
            self.touches.flush()

    # -- the rest --------------------------------------------------------------

    def stats(self) -> StoreStats:
        """Directory-wide totals from the index plus this handle's counters."""
        self._check_fork()
        total, chunks, blocks = self.index.totals()
        return StoreStats(
            total_bytes=total,
            capacity_bytes=self.config.capacity,
            num_chunks=chunks,
            num_blocks=blocks,
            counters=self.counters.snapshot(),
            claims_held=self.claims.held(),
        )

    def check(self, *, verify_data: bool = False, fix: bool = False) -> list[str]:
        """Verify every invariant of the directory; returns the problems found.

        Args:
            verify_data: also read every live row and check its checksums.
            fix: delete crash leftovers (tmp garbage, orphan chunk files).

        This handle's deferred unlinks happen first (their files would read as
        orphans).
        """
        from npukv_store.store.check import check_store

        self._check_fork()
        self.flush_touches()
        # this handle's deferred files would read as orphans (0070)
        self.publisher.sweep_deferred(everything=True)
        return check_store(
            self.dir, self.index, self.config, verify_data=verify_data, fix=fix
        )

    def close(self) -> None:
        """Flush touches and release the index. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if os.getpid() == self._pid:
            if self._parent is not None:
                self.flush()  # the shared writer publishes through our index
            if self._async is not None:
                self._async.close()  # drains complete batches into the index
            self.touches.stop()  # after the drain: its commits may evict
            self.publisher.forget_unlinked()
            self._reader.close()
            self.claims.close()
            self._session.end()  # a clean close: no scan for our sake
            self.index.close()
            self.dir.close()  # the root's descriptor (reopened if used again)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
