"""The shared index of a cache directory: an LMDB environment under ``index/``.

Runs in: every process that opens the store; one environment per process and
directory (LMDB forbids opening one twice in a process), shared by handles.
Thread-safe: LMDB read transactions are per thread, write transactions serialise
on LMDB's robust process-shared mutex, so a writer killed mid-transaction leaves
the last committed state and the lock is recovered by the next writer.

    lookup_prefix() - longest stored prefix of a key chain
    locate()        - (chunk id, row) of each key
    commit_chunk()  - publish a chunk's rows, first commit wins, evict to capacity
    remove_chunks() - unpublish chunks (the caller unlinks their files after)
    touch()         - move chunks to the young end of the LRU
    pin_keys()      - pin keys for a pin the operator made (npukv pin);
    unpin()         - and undo it (docs/decisions/0067)
    removed_since() - the keys that left the index since a position of its
                      removal log (KV events: docs/decisions/0066)

Databases (keys and values are fixed-layout bytes: :mod:`.index_rows`):
    keys    16-byte block key -> chunk id u64, row u32   (the block's home);
            row 0 of a chunk whose rows are all home: then the keys of its
            other rows (so a chain's lookup descends once per chunk)
    chunks  chunk id u64 BE   -> ChunkRecord              (one per published chunk)
    lru     tenant 8 bytes + last access ns u64 BE + chunk id u64 BE -> ''
            (eviction order within each tenant; pinned chunks have none)
    meta    b"schema" -> SCHEMA, b"total_bytes" -> u64    (global capacity ledger),
            b"tenant/" + tenant -> u64 (each tenant's part of it),
            b"capacity" -> u64 and b"shares" -> (tenant, u64)* (the latest
            commit's capacity and tenant shares: what the maintenance job and
            ``npukv stats`` report against), b"pin/" + id -> a pin's JSON
    dead    chunk id u64 BE   -> namespace 16 bytes       (unpublished, file may
                                                         still await its unlink)
    removed sequence u64 BE   -> 16-byte keys              (the keys one unpublish
            took out of ``keys``, oldest first, at most REMOVED_LOG_ENTRIES)
    pins    pinned keys, both ways (:mod:`.index_pins`)

The index is a cache of what the chunk files say; :mod:`.recovery` rebuilds it.
Why LMDB and not SQLite: docs/decisions/0001 (measured 256-key lookups and commits).
Over 400 lines because each write is one LMDB transaction, so each lives in
one method of the one class that holds the environment; the bytes of the
rows are in :mod:`.index_rows`.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from itertools import repeat

import lmdb

from npukv_store.errors import FormatError
from npukv_store.store import index_admission, index_pins, lru_order, policy
from npukv_store.store.envs import open_env, release_env
from npukv_store.store.index_pins import PIN_RECORD, PinDbs
from npukv_store.store.index_rows import (
    CID,
    HOME,
    LOC_FMT,
    LRU_FMT,
    SHARES,
    U64,
    ChunkRecord,
    CommitResult,
    Ledger,
    RemovedKeys,
    listed_run,
    pack_shares,
    prefixed,
    tenant_usage,
    total_bytes,
    unpack_shares,
    whole_home,
)
from npukv_store.store.permissions import Access

SEQ = CID  # a removal log entry's position: u64 big-endian, so the log sorts
#: what a caller runs inside a write transaction, given its victims
InTxn = Callable[[lmdb.Transaction, Sequence[ChunkRecord]], None]

#: 2: row 0 of a whole chunk lists its other keys; 3: tenants and pins
SCHEMA = b"npukv-index-3"
#: entries kept in the removal log (one per unpublished chunk that lost keys):
#: a reader further behind sees a gap (docs/decisions/0066)
REMOVED_LOG_ENTRIES = 8192


class Index:
    """A handle on the shared LMDB index of one cache directory."""

    def __init__(
        self, path: str, *, map_size: int, sync: bool, access: Access | None = None
    ) -> None:
        """Open (creating if needed) the index at ``path``.

        Args:
            access: who may use the cache (default: private): the modes of
                what is created, and the owner what is there must have.

        Raises:
            FormatError: the environment exists but is unreadable or of another
                schema; recovery then rebuilds it from the chunks.
            UnsafeEntry: ``path`` or its files are symlinks or someone else's.
        """
        self.path = path
        self._released = True
        self._shares_cache: tuple[Mapping[bytes, int], bytes] | None = None
        try:
            self._env = open_env(path, map_size, sync, access)
            self._released = False
        except lmdb.Error as exc:
            raise FormatError(f"{path}: index unreadable ({exc})") from exc
        try:
            schema = self._open_dbs()
        except lmdb.Error as exc:
            self.close()
            raise FormatError(f"{path}: index unreadable ({exc})") from exc
        if schema not in (None, SCHEMA):
            self.close()
            raise FormatError(f"{path}: index schema {schema!r}, expected {SCHEMA!r}")

    def _open_dbs(self) -> bytes | None:
        """Open the eight databases; the schema found (None: a new index).
        ``admission`` is read and written by :mod:`.index_admission` inside
        this class's transactions (an older release ignores it).

        One explicit write transaction: ``open_db`` without one begins it
        holding the GIL, which deadlocks against a thread of ours
        mid-commit. (A read transaction cannot open them: py-lmdb aborts a
        read transaction at commit, which closes the handles.) Where the
        databases exist it writes nothing, so its commit flushes nothing:
        it holds LMDB's writer lock for microseconds.
        """
        with self._env.begin(write=True) as txn:
            names = (
                b"keys", b"chunks", b"lru", b"meta", b"dead", b"removed", b"pins",
                b"admission",
            )  # fmt: skip
            dbs = [self._env.open_db(name, txn=txn) for name in names]
            schema = txn.get(b"schema", db=dbs[3])
            if schema is None:
                txn.put(b"schema", SCHEMA, db=dbs[3])
                txn.put(b"total_bytes", U64.pack(0), db=dbs[3])
        self._keys, self._chunks, self._lru, self._meta, self._dead = dbs[:5]
        self._removed, self._pins, self.admission_db = dbs[5:]
        self._pin_dbs = PinDbs(self._pins, self._keys, self._chunks, self._lru)
        return schema

    def admission_report(self) -> dict[str, object]:
        """The directory's admission state (:func:`.index_admission.report`)."""
        with self._env.begin() as txn:
            return index_admission.report(txn, self.admission_db)

    def admission_problems(self) -> list[str]:
        """What is inconsistent in the admission tables (for ``npukv verify``
        and the tests)."""
        with self._env.begin() as txn:
            return index_admission.check(txn, self.admission_db)

    def begin_read(self) -> lmdb.Transaction:
        """A read transaction (a snapshot; never blocked by writers)."""
        return self._env.begin()

    def close(self) -> None:
        """Release this handle; the environment closes with its last handle."""
        if not getattr(self, "_released", True):
            self._released = True
            release_env(self.path)

    # -- reads: never blocked by writers (MVCC snapshot) -----------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Length of the longest stored prefix of ``keys``.

        One cursor ``set_key`` per key looked up, the cursor reused (docs/
        decisions/0001), and one per chunk for a chain (see :meth:`locate`).
        """
        count, i = len(keys), 0
        with self._env.begin(db=self._keys) as txn:
            cursor = txn.cursor()
            find, value = cursor.set_key, cursor.value
            while i < count and find(keys[i]):
                i += 1
                home = value()
                if len(home) > HOME and i < count:
                    i += listed_run(home, keys, i)
        return i

    def locate(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """``(chunk id, row)`` of each key, or None where it is not stored.

        A chain's keys mostly sit in one chunk after another, row after row,
        and the keys db value of a chunk's row 0 lists the keys of its other
        rows when all of them are home there: one B-tree descent then locates
        a chunk's worth of a chain (docs/decisions/0060).
        """
        found: list[tuple[int, int] | None] = []
        count, i = len(keys), 0
        unpack_home = LOC_FMT.unpack_from
        with self._env.begin(db=self._keys) as txn:
            cursor = txn.cursor()
            find, value = cursor.set_key, cursor.value
            while i < count:
                i += 1
                if not find(keys[i - 1]):
                    found.append(None)
                    continue
                home = value()
                location = unpack_home(home)
                found.append(location)
                if len(home) > HOME and i < count:
                    run = listed_run(home, keys, i)
                    found.extend(zip(repeat(location[0]), range(1, 1 + run)))
                    i += run
        return found

    def chunk(self, chunk_id: int) -> ChunkRecord | None:
        """The record of a published chunk, or None."""
        with self._env.begin(db=self._chunks) as txn:
            raw = txn.get(CID.pack(chunk_id))
        return None if raw is None else ChunkRecord.unpack(chunk_id, raw)

    def iter_chunks(self) -> Iterator[ChunkRecord]:
        """Every published chunk (one consistent snapshot)."""
        with self._env.begin(db=self._chunks) as txn:
            for raw_id, raw in txn.cursor():
                yield ChunkRecord.unpack(CID.unpack(raw_id)[0], raw)

    def iter_keys(self) -> Iterator[tuple[bytes, int, int]]:
        """Every ``(key, chunk id, row)`` (one consistent snapshot)."""
        with self._env.begin(db=self._keys) as txn:
            for key, raw in txn.cursor():
                chunk_id, row = LOC_FMT.unpack_from(raw)
                yield bytes(key), chunk_id, row

    def iter_lru(self) -> Iterator[tuple[int, int]]:
        """Every ``(last access ns, chunk id)`` of the LRU, oldest first over
        all tenants (pinned chunks are not in it)."""
        with self._env.begin(db=self._lru) as txn:
            runs = [
                self._tenant_lru(txn, tenant)
                for tenant in tenant_usage(txn, self._meta)
            ]
            yield from heapq.merge(*runs)

    def recorded_capacity(self) -> int | None:
        """The ``capacity`` of the latest committing process (None before the
        first commit): the directory does not store its config, and the
        maintenance job and ``npukv stats`` need the budget the servers run to."""
        with self._env.begin(db=self._meta) as txn:
            raw = txn.get(b"capacity")
        return None if raw is None else int(U64.unpack(raw)[0])

    def tenants(self) -> tuple[dict[bytes, int], dict[bytes, int]]:
        """Each tenant's bytes (the ledger) and share in bytes (the latest
        committer's; absent: 0), from one snapshot."""
        with self._env.begin(db=self._meta) as txn:
            return tenant_usage(txn, self._meta), unpack_shares(txn.get(SHARES))

    def totals(self) -> tuple[int, int, int]:
        """``(total bytes, chunks, keys)`` from the ledger and the db sizes."""
        with self._env.begin() as txn:
            total = total_bytes(txn, self._meta)
            return (
                total,
                txn.stat(self._chunks)["entries"],
                txn.stat(self._keys)["entries"],
            )

    # -- writes: one short LMDB transaction each ------------------------------

    def commit_chunk(
        self,
        record: ChunkRecord,
        *,
        capacity_bytes: int,
        grace_ns: int = 0,
        touched: Iterable[bytes] = (),
        unlinked: Iterable[int] = (),
        shares: Mapping[bytes, int] | None = None,
        in_txn: InTxn | None = None,
        parents: Iterable[bytes] = (),
    ) -> CommitResult:
        """Publish ``record``: each key absent from the index gets this chunk's row.

        Keys already stored keep their home (first commit wins) and this chunk's
        row is dead space. If the chunk wins no row, nothing is published. To stay
        within ``capacity_bytes``, chunks are evicted by :func:`.policy.pick_victims`
        (the oldest of the tenants over their ``shares``, then the committing
        tenant's own), in LRU order whatever their age (``grace_ns`` is unused:
        the publisher defers the unlink of a young victim, docs/decisions/0070);
        only chunks newer than this one are spared, and if that cannot make
        room (pins, shares, or the chunk is older than all else) it is rejected
        (a cache may refuse; it must not overflow), and so is a chunk one of
        whose ``parents`` is not stored (it would be stranded at birth). Its
        LRU time is below that of the chunks holding its ``parents`` (the keys
        of the blocks before its rows' runs: :func:`.lru_order.parent_bound`),
        and ``touched`` chunk ids
        (from lookups, in chain order) are refreshed above it, and the
        tombstones of ``unlinked`` chunks (files removed since) are dropped, in
        the same transaction. ``shares`` (tenant -> bytes) are recorded for the
        maintenance job; None keeps the recorded ones. ``in_txn`` runs in
        the same transaction once the chunk is published, with the victims
        (the admission state's pending changes: :mod:`.index_admission`).
        """
        with self._env.begin(write=True) as txn:
            self._touch_in(txn, touched, record.last_access_ns + 1)
            self._forget_in(txn, unlinked)
            bound, orphan = lru_order.parent_bound(
                txn, self._keys, self._chunks, record, parents
            )
            if orphan:  # its parent is gone: it would be stranded at birth
                return CommitResult(0, True, ())
            if bound is not None and bound < record.last_access_ns:
                record = replace(record, last_access_ns=bound)
            ledger = Ledger(txn, self._meta)
            excess = ledger.total + record.size_bytes - capacity_bytes
            rule = shares
            if rule is None and excess > 0:
                rule = unpack_shares(txn.get(SHARES, db=self._meta))
            victims, covered = self._pick_victims(
                txn, excess, record.last_access_ns, rule or {}, record.tenant
            )
            if not covered:
                return CommitResult(0, True, ())
            # Victims go first: a key whose home is a victim is then free for
            # this chunk, instead of vanishing from the index with the victim.
            gone: list[bytes] = []
            for victim in victims:
                gone += self._unpublish_in(txn, victim, log=False)
                ledger.add(victim.tenant, -victim.size_bytes)
            live = self._publish_in(txn, record)
            if live == 0:
                txn.abort()  # nothing won: evicting for it would be pure loss
                return CommitResult(0, False, ())
            if live < len(record.keys):  # rows won elsewhere: parents there
                self._lower_below_parents(txn, record)
            kept = set(record.keys)  # a victim's key this chunk took over stays
            gone = [key for key in gone if key not in kept]
            if gone:
                self._log_removed_in(txn, b"".join(gone))
            ledger.add(record.tenant, record.size_bytes)
            ledger.write()
            if in_txn is not None:
                in_txn(txn, victims)
            if capacity_bytes < 1 << 62:  # rebuilds pass "unlimited"
                txn.put(b"capacity", U64.pack(capacity_bytes), db=self._meta)
                if shares is not None:
                    packed = self._packed_shares(shares)
                    if txn.get(SHARES, db=self._meta) != packed:
                        txn.put(SHARES, packed, db=self._meta)
        return CommitResult(live, False, tuple(victims))

    def _lower_below_parents(self, txn: lmdb.Transaction, record: ChunkRecord) -> None:
        """A published ``record`` some of whose rows another chunk won since
        the claim: that chunk holds the parent of the next row of ours, so
        ours goes below it too (:func:`.lru_order.lost_parents`)."""
        lost = lru_order.lost_parents(txn, self._keys, record)
        bound, _ = lru_order.parent_bound(txn, self._keys, self._chunks, record, lost)
        raw = txn.get(CID.pack(record.chunk_id), db=self._chunks)
        if bound is None or raw is None:
            return
        rec = ChunkRecord.unpack(record.chunk_id, raw)
        if rec.pinned or bound >= rec.last_access_ns:
            return
        txn.delete(rec.lru_key, db=self._lru)
        rec = replace(rec, last_access_ns=bound)
        txn.put(rec.lru_key, b"", db=self._lru)
        txn.put(CID.pack(rec.chunk_id), rec.pack(), db=self._chunks)

    def _packed_shares(self, shares: Mapping[bytes, int]) -> bytes:
        """``shares`` as the meta record holds them, packed once per mapping
        (a publisher passes the same one to every commit)."""
        cached = self._shares_cache
        if cached is None or cached[0] is not shares:
            cached = self._shares_cache = (shares, pack_shares(dict(shares)))
        return cached[1]

    def _publish_in(self, txn: lmdb.Transaction, record: ChunkRecord) -> int:
        """Give each of ``record``'s keys absent from the index this chunk's
        row, and publish the record if it won a row; the rows won. Leaves the
        ledger to the caller (bench/index_fill.py adds many chunks per txn)."""
        won = [
            key
            for row, key in enumerate(record.keys)
            if txn.put(
                key, LOC_FMT.pack(record.chunk_id, row), overwrite=False, db=self._keys
            )
        ]
        live = len(won)
        if live == len(record.keys) > 1:  # all rows home: row 0 lists the others
            txn.put(record.keys[0], whole_home(record), db=self._keys)
        if live:  # pinned if a pin holds a row it won (not one homed elsewhere)
            pinned = index_pins.any_pinned(txn, self._pins, won)
            rec = replace(record, live_rows=live, pinned=pinned)
            txn.put(CID.pack(rec.chunk_id), rec.pack(), db=self._chunks)
            if not pinned:
                txn.put(rec.lru_key, b"", db=self._lru)
        return live

    def replace_chunks(
        self,
        record: ChunkRecord,
        sources: Sequence[tuple[int, int]],
        old_ids: Iterable[int],
    ) -> tuple[int, list[ChunkRecord]]:
        """Compaction's commit: publish ``record``, a rewrite of rows of the
        ``old_ids`` chunks, and unpublish those chunks, in one transaction.

        ``sources[row]`` is where row ``row`` of ``record`` was copied from. A
        key moves to the new chunk only if its home is still that source row: a
        key evicted or moved meanwhile stays as it is, and its new row is dead
        space. The new chunk takes the oldest access of the old ones: below
        every source's parent, so a parent still outlives it (docs/decisions/
        0070; a child of a newer source may then outlive it).

        Returns:
            The rows won and the old records unpublished; ``(0, [])`` when no
            row was won, or when the new chunk is larger than the old chunks
            still published (nothing changes; the caller deletes the new file).
        """
        with self._env.begin(write=True) as txn:
            live = 0
            moved: dict[int, int] = {}  # source chunk id -> rows it lost
            for row, (key, source) in enumerate(zip(record.keys, sources, strict=True)):
                home = txn.get(key, db=self._keys)
                if home is not None and home[: LOC_FMT.size] == LOC_FMT.pack(*source):
                    txn.put(key, LOC_FMT.pack(record.chunk_id, row), db=self._keys)
                    live += 1
                    moved[source[0]] = moved.get(source[0], 0) + 1
            if live == 0:
                txn.abort()
                return 0, []
            if live == len(record.keys) > 1:
                txn.put(record.keys[0], whole_home(record), db=self._keys)
            ledger = Ledger(txn, self._meta)
            removed, last = [], 1 << 64  # the oldest source's, below
            for chunk_id in old_ids:
                raw = txn.get(CID.pack(chunk_id), db=self._chunks)
                if raw is None:
                    continue  # evicted meanwhile
                old = ChunkRecord.unpack(chunk_id, raw)
                if old.pinned or old.tenant != record.tenant:
                    # pinned since the plan: compaction never moves a pinned
                    # block (and a chunk holds one tenant's blocks)
                    txn.abort()
                    return 0, []
                self._unpublish_in(txn, old)
                ledger.add(old.tenant, -old.size_bytes)
                last = min(last, old.last_access_ns)
                removed.append(old)
            # A source left published is no longer whole: its row 0 must stop
            # vouching for rows moved away (lookups trust it), and its live
            # count must stay true.
            for chunk_id, lost in moved.items():
                raw = txn.get(CID.pack(chunk_id), db=self._chunks)
                if raw is not None:
                    old = ChunkRecord.unpack(chunk_id, raw)
                    left = replace(old, live_rows=old.live_rows - lost)
                    txn.put(CID.pack(chunk_id), left.pack(), db=self._chunks)
                    home = txn.get(old.keys[0], db=self._keys)
                    if home is not None and home[: LOC_FMT.size] == LOC_FMT.pack(
                        chunk_id, 0
                    ):
                        txn.put(old.keys[0], LOC_FMT.pack(chunk_id, 0), db=self._keys)
            if record.size_bytes > sum(old.size_bytes for old in removed):
                # Sources evicted since the plan left their rows in the new
                # chunk as dead space: publishing it would grow the ledger,
                # past capacity too (a commit evicts for room, this does not).
                # A rewrite that does not shrink is no compaction: none.
                txn.abort()
                return 0, []
            rec = replace(record, live_rows=live, last_access_ns=last)
            txn.put(CID.pack(rec.chunk_id), rec.pack(), db=self._chunks)
            txn.put(rec.lru_key, b"", db=self._lru)
            ledger.add(rec.tenant, rec.size_bytes)
            ledger.write()
        return live, removed

    def evict(
        self, excess: int, *, young_after_ns: int, in_txn: InTxn | None = None
    ) -> list[ChunkRecord]:
        """Unpublish chunks until ``excess`` bytes are gone, by the commits'
        rule without a committer: the oldest of the tenants over their
        recorded shares, sparing chunks used after ``young_after_ns`` (the
        maintenance job's eviction down to a target). Evicts as much as the
        rule allows when it cannot cover all of ``excess``."""
        with self._env.begin(write=True) as txn:
            shares = unpack_shares(txn.get(SHARES, db=self._meta))
            victims, _ = self._pick_victims(txn, excess, young_after_ns, shares, None)
            ledger = Ledger(txn, self._meta)
            for victim in victims:
                self._unpublish_in(txn, victim)
                ledger.add(victim.tenant, -victim.size_bytes)
            ledger.write()
            if in_txn is not None:
                in_txn(txn, victims)
        return victims

    def evict_plan(self, excess: int, grace_s: float) -> list[int]:
        """The chunk ids :meth:`evict` would remove now (for a dry run)."""
        young_after = time.time_ns() - int(grace_s * 1e9)
        with self._env.begin() as txn:
            shares = unpack_shares(txn.get(SHARES, db=self._meta))
            victims, _ = self._pick_victims(txn, excess, young_after, shares, None)
        return [victim.chunk_id for victim in victims]

    def remove_chunks(self, chunk_ids: Iterable[int]) -> list[ChunkRecord]:
        """Unpublish chunks; returns their records so the caller can unlink files."""
        removed: list[ChunkRecord] = []
        with self._env.begin(write=True) as txn:
            ledger = Ledger(txn, self._meta)
            for chunk_id in chunk_ids:
                raw = txn.get(CID.pack(chunk_id), db=self._chunks)
                if raw is None:
                    continue
                record = ChunkRecord.unpack(chunk_id, raw)
                self._unpublish_in(txn, record)
                ledger.add(record.tenant, -record.size_bytes)
                removed.append(record)
            ledger.write()
        return removed

    def dead_chunks(self) -> dict[int, bytes]:
        """Tombstones: chunk id -> namespace of unpublished chunks whose file
        may still exist (the unlink follows the commit)."""
        with self._env.begin(db=self._dead) as txn:
            return {CID.unpack(k)[0]: bytes(v) for k, v in txn.cursor()}

    def forget_dead(self, chunk_ids: Iterable[int]) -> None:
        """Drop tombstones once their files are gone."""
        with self._env.begin(write=True) as txn:
            self._forget_in(txn, chunk_ids)

    def _forget_in(self, txn: lmdb.Transaction, chunk_ids: Iterable[int]) -> None:
        for chunk_id in chunk_ids:
            txn.delete(CID.pack(chunk_id), db=self._dead)

    def touch(
        self, chunk_ids: Iterable[bytes], now_ns: int, in_txn: InTxn | None = None
    ) -> None:
        """Mark chunks (8-byte little-endian ids) as used at ``now_ns``;
        ``in_txn`` runs in the same transaction (no victims)."""
        with self._env.begin(write=True) as txn:
            self._touch_in(txn, chunk_ids, now_ns)
            if in_txn is not None:
                in_txn(txn, ())

    def _touch_in(
        self, txn: lmdb.Transaction, chunk_ids: Iterable[bytes], now_ns: int
    ) -> None:
        """Chunks in chain order (parents first) get ``now + (n-1-i)`` ns: a
        parent stays newer than its children (:func:`.lru_order.touch_times`)."""
        chunk_ids = list(chunk_ids)
        times = lru_order.touch_times(now_ns, len(chunk_ids))
        for raw_id, at_ns in zip(chunk_ids, times, strict=True):
            chunk_id = U64.unpack(raw_id)[0]
            cid = CID.pack(chunk_id)
            raw = txn.get(cid, db=self._chunks)
            if raw is None:
                continue  # evicted since the lookup: nothing to refresh
            record = ChunkRecord.unpack(chunk_id, raw)
            if record.last_access_ns >= at_ns:
                continue
            fresh = replace(record, last_access_ns=at_ns)
            if not record.pinned:  # a pinned chunk has no LRU entry
                txn.delete(record.lru_key, db=self._lru)
                txn.put(fresh.lru_key, b"", db=self._lru)
            txn.put(cid, fresh.pack(), db=self._chunks)

    def _pick_victims(
        self,
        txn: lmdb.Transaction,
        excess: int,
        young_after_ns: int,
        shares: Mapping[bytes, int],
        committer: bytes | None,
    ) -> tuple[list[ChunkRecord], bool]:
        """Records of the chunks :func:`.policy.pick_victims` picks from this
        transaction's LRU, and whether they cover ``excess``."""
        if excess <= 0:
            return [], True
        records: dict[int, ChunkRecord] = {}

        def size_of(chunk_id: int) -> int:
            raw = txn.get(CID.pack(chunk_id), db=self._chunks) or b""
            records[chunk_id] = ChunkRecord.unpack(chunk_id, raw)
            return records[chunk_id].size_bytes

        usage = tenant_usage(txn, self._meta)
        tenants = set(usage) | ({committer} if committer is not None else set())
        runs = {tenant: self._tenant_lru(txn, tenant) for tenant in tenants}
        victims, covered = policy.pick_victims(
            runs, size_of, excess, young_after_ns, usage, shares, committer
        )
        return [records[cid] for cid in victims], covered

    def _tenant_lru(
        self, txn: lmdb.Transaction, tenant: bytes
    ) -> Iterator[tuple[int, int]]:
        """``(last access ns, chunk id)`` of ``tenant``'s chunks in the LRU,
        oldest first, read lazily (its cursor opens at the first ``next``)."""
        cursor = txn.cursor(db=self._lru)
        if not cursor.set_range(tenant):
            return
        for raw in cursor.iternext(keys=True, values=False):
            owner, last_ns, chunk_id = LRU_FMT.unpack(raw)
            if owner != tenant:
                return
            yield last_ns, chunk_id

    def _unpublish_in(
        self, txn: lmdb.Transaction, record: ChunkRecord, *, log: bool = True
    ) -> list[bytes]:
        """Take ``record`` out of the index; the keys that left with it,
        logged unless ``log`` is False (the caller logs what stays gone)."""
        cursor = txn.cursor(db=self._keys)  # one descent per key, not two
        gone = []
        for row, key in enumerate(record.keys):
            home = LOC_FMT.pack(record.chunk_id, row)
            if cursor.set_key(key) and cursor.value()[: LOC_FMT.size] == home:
                cursor.delete()  # only rows this chunk is home of
                gone.append(key)
        if gone and log:
            self._log_removed_in(txn, b"".join(gone))
        if not record.pinned:
            txn.delete(record.lru_key, db=self._lru)
        txn.delete(CID.pack(record.chunk_id), db=self._chunks)
        # The file outlives this commit until its unlink; if the unlinker dies in
        # between, the tombstone tells recovery the file is dead, not in flight.
        txn.put(CID.pack(record.chunk_id), record.namespace, db=self._dead)
        return gone

    # -- the removal log: which keys left, for every process (KV events) -----

    def _log_removed_in(self, txn: lmdb.Transaction, keys: bytes) -> None:
        """Append ``keys`` (16 bytes each) to the removal log, dropping its
        oldest entry beyond REMOVED_LOG_ENTRIES: one put and at most one
        delete per unpublished chunk, in the unpublishing transaction."""
        cursor = txn.cursor(db=self._removed)
        last = SEQ.unpack(cursor.key())[0] if cursor.last() else -1
        txn.put(SEQ.pack(last + 1), keys, db=self._removed)
        oldest = SEQ.unpack(cursor.key())[0] if cursor.first() else last + 1
        if last + 1 - oldest >= REMOVED_LOG_ENTRIES:
            cursor.delete()

    def removed_position(self) -> int:
        """The position the next removal will have: a reader that starts now
        reads from here."""
        with self._env.begin(db=self._removed) as txn:
            cursor = txn.cursor()
            return SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0

    def removed_since(self, position: int, limit: int = 256) -> RemovedKeys:
        """The keys removed from ``position`` on (at most ``limit`` entries of
        the log), where to read next, and whether entries were lost between
        ``position`` and the oldest one kept (or the index was rebuilt, which
        starts a new log: ``position`` past its end)."""
        keys: list[bytes] = []
        with self._env.begin(db=self._removed) as txn:
            cursor = txn.cursor()
            end = SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0
            if position > end:
                return RemovedKeys(end, [], True)
            first = SEQ.unpack(cursor.key())[0] if cursor.first() else end
            gap = position < first
            nxt = max(position, first)
            start = nxt
            if cursor.set_range(SEQ.pack(nxt)):
                for raw, blob in cursor:
                    if nxt - start >= limit:
                        break
                    nxt = SEQ.unpack(raw)[0] + 1
                    keys += [bytes(blob[i : i + 16]) for i in range(0, len(blob), 16)]
        return RemovedKeys(nxt, keys, gap)

    # -- recovery's records: sessions, the rebuild mark (docs/decisions/0059) --

    def meta_records(self, prefix: bytes) -> dict[bytes, bytes]:
        """The meta records whose key starts with ``prefix``."""
        with self._env.begin(db=self._meta) as txn:
            return {prefix + k: v for k, v in prefixed(txn.cursor(), prefix)}

    def add_meta(self, key: bytes, value: bytes, *, overwrite: bool = False) -> bool:
        """Write a meta record (only where absent unless ``overwrite``), then
        sync even an unsynced index: recovery's records must outlive a power
        cut. False when the record was there and not overwritten."""
        with self._env.begin(write=True, db=self._meta) as txn:
            added = bool(txn.put(key, value, overwrite=overwrite))
        self._env.sync(True)
        return added

    def forget_meta(self, expected: dict[bytes, bytes]) -> None:
        """Delete each meta record that still holds its ``expected`` value."""
        with self._env.begin(write=True, db=self._meta) as txn:
            for key, value in expected.items():
                if txn.get(key) == value:
                    txn.delete(key)

    def chunk_ids_unless(self, mark: bytes) -> set[int] | None:
        """Every published chunk id (keys only, no record decoded), or None
        when meta record ``mark`` exists, in one snapshot."""
        with self._env.begin() as txn:
            if txn.get(mark, db=self._meta) is not None:
                return None
            ids = txn.cursor(db=self._chunks).iternext(keys=True, values=False)
            return {CID.unpack(raw)[0] for raw in ids}

    def commit_rebuilt(self, records: Sequence[ChunkRecord]) -> int:
        """A rebuild's commit: many chunks in one transaction, first commit
        wins, no eviction; a chunk already published or tombstoned (evicted
        since the rebuild read its file) is skipped. Returns chunks published."""
        published = 0
        with self._env.begin(write=True) as txn:
            ledger = Ledger(txn, self._meta)
            for record in records:
                cid = CID.pack(record.chunk_id)
                if txn.get(cid, db=self._chunks) or txn.get(cid, db=self._dead):
                    continue
                if self._publish_in(txn, record):
                    ledger.add(record.tenant, record.size_bytes)
                    published += 1
            ledger.write()
        return published

    # -- pins: keys eviction and compaction never drop (docs/decisions/0067) --

    def add_pin(self, pin_id: bytes, record: bytes) -> None:
        """Record a pin (its JSON: :class:`~.pins.PinRecord`); servers apply
        it to their keys when they meet its prompt."""
        self.add_meta(PIN_RECORD + pin_id, record, overwrite=True)

    def pin_records(self) -> dict[bytes, bytes]:
        """pin id -> the pin's JSON, for every pin."""
        with self._env.begin(db=self._meta) as txn:
            return dict(prefixed(txn.cursor(), PIN_RECORD))

    def pin_applied(self, pin_id: bytes, key: bytes) -> bool:
        """Whether ``pin_id`` holds ``key`` already (a server's check before
        it applies a pin: one read)."""
        with self._env.begin(db=self._pins) as txn:
            return txn.get(index_pins.KEY_SIDE + key + pin_id) is not None

    def pin_keys(self, pin_id: bytes, keys: Sequence[bytes]) -> int | None:
        """Pin ``keys`` (stored or not) under ``pin_id``: their chunks leave
        the LRU. Returns the chunks newly pinned, or None when the pin is gone
        (unpinned since the caller read it: nothing is pinned)."""
        with self._env.begin(write=True) as txn:
            if txn.get(PIN_RECORD + pin_id, db=self._meta) is None:
                return None
            return len(index_pins.pin_keys(txn, self._pin_dbs, pin_id, keys))

    def unpin(self, pin_id: bytes) -> bool:
        """Remove a pin and its keys; chunks no other pin holds go back to the
        LRU at their last access. False when there was no such pin."""
        with self._env.begin(write=True) as txn:
            found = txn.delete(PIN_RECORD + pin_id, db=self._meta)
            index_pins.unpin(txn, self._pin_dbs, pin_id)
        return bool(found)

    def pinned_key_set(self) -> set[bytes]:
        """Every key some pin holds (for checks: reads the whole pins db)."""
        with self._env.begin(db=self._pins) as txn:
            side = index_pins.KEY_SIDE
            return {
                bytes(raw[1:17])
                for raw in txn.cursor().iternext(keys=True, values=False)
                if raw[:1] == side
            }

    def pinned_keys(self, pin_id: bytes) -> int:
        """How many keys ``pin_id`` holds (over every namespace)."""
        with self._env.begin() as txn:
            return index_pins.pinned_key_count(txn, self._pins, pin_id)
