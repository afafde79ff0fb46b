"""The bytes of the index's rows: the fixed layouts of its LMDB values and
the record of a published chunk. :mod:`.index` keeps them in LMDB; this module
says what each value holds (docs/decisions/0060 for row 0's list).

    ChunkRecord  - one published chunk: namespace, size, rows, LRU times,
                   keys, tenant, pinned
    CommitResult - what a commit did: rows won, whether refused, victims
    whole_home() - row 0's keys db value in a chunk whose rows are all home
    listed_run() - how many keys of a chain row 0's list vouches for
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import lmdb

from npukv_store.keying import DEFAULT_TENANT

LOC_FMT = struct.Struct("<QI")  # keys db value: chunk id, row
#: ns, size, rows, live rows, last ns, created ns, tenant, flags
REC_FMT = struct.Struct("<16sQIIQQ8sI")
#: tenant, last access ns, chunk id: big-endian, so within a tenant byte
#: order is time order (each tenant's chunks are one run, oldest first)
LRU_FMT = struct.Struct(">8sQQ")
PINNED = 1  # ChunkRecord flag: a key of the chunk is pinned (it has no LRU entry)
U64 = struct.Struct("<Q")
CID = struct.Struct(">Q")
KEY = 16  # bytes of a block key
HOME = LOC_FMT.size  # where row 0's list of the other keys starts


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One published chunk, as the index knows it."""

    chunk_id: int
    namespace: bytes
    size_bytes: int
    num_rows: int
    live_rows: int
    last_access_ns: int
    created_ns: int
    keys: tuple[bytes, ...]
    tenant: bytes = DEFAULT_TENANT  # whose saves made it (docs/decisions/0067)
    pinned: bool = False  # a key of it is pinned: never evicted, not in the LRU

    @classmethod
    def new(
        cls,
        chunk_id: int,
        namespace: bytes,
        keys: Sequence[bytes],
        size_bytes: int,
        created_ns: int,
        tenant: bytes = DEFAULT_TENANT,
    ) -> ChunkRecord:
        """The record of a chunk about to be committed (rows not yet won)."""
        return cls(
            chunk_id, namespace, size_bytes, len(keys), 0, created_ns, created_ns,
            tuple(keys), tenant,
        )  # fmt: skip

    @property
    def read_since_written(self) -> bool:
        """Whether a lookup touched it after its write: a commit never dates a
        chunk after its ``created_ns`` (it may date it before, below its
        parent: docs/decisions/0070), a touch always does."""
        return self.last_access_ns > self.created_ns

    @property
    def lru_key(self) -> bytes:
        """Its entry in the lru db (pinned chunks have none)."""
        return LRU_FMT.pack(self.tenant, self.last_access_ns, self.chunk_id)

    def pack(self) -> bytes:
        head = REC_FMT.pack(
            self.namespace,
            self.size_bytes,
            self.num_rows,
            self.live_rows,
            self.last_access_ns,
            self.created_ns,
            self.tenant,
            PINNED if self.pinned else 0,
        )
        return head + b"".join(self.keys)

    @classmethod
    def unpack(cls, chunk_id: int, raw: bytes | memoryview) -> ChunkRecord:
        ns, size, rows, live, last, created, tenant, flags = REC_FMT.unpack_from(raw)
        blob = bytes(raw[REC_FMT.size :])
        keys = tuple(blob[i : i + 16] for i in range(0, len(blob), 16))
        return cls(
            chunk_id, ns, size, rows, live, last, created, keys, tenant,
            bool(flags & PINNED),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What :meth:`Index.commit_chunk` did: rows won, and chunks evicted for room."""

    live_rows: int
    rejected: bool
    victims: tuple[ChunkRecord, ...]


def whole_home(record: ChunkRecord) -> bytes:
    """Row 0's keys db value in a chunk whose rows are all home: its home,
    then the keys of its other rows."""
    return LOC_FMT.pack(record.chunk_id, 0) + b"".join(record.keys[1:])


def listed_run(home: bytes, keys: Sequence[bytes], start: int) -> int:
    """How many keys from ``keys[start]`` on are the next rows of the whole
    chunk whose row 0's keys db value is ``home`` (that value lists them)."""
    others = home[HOME:]
    wanted = keys[start : start + len(others) // KEY]
    joined = b"".join(wanted)
    # 16 bytes a key on average, and none shorter: every key is 16 bytes
    if (
        others.startswith(joined)
        and len(joined) == KEY * len(wanted)
        and min(map(len, wanted)) == KEY
    ):
        return len(wanted)
    same = 0  # some key differs: count those before it
    for at, key in zip(range(0, len(others), KEY), wanted, strict=False):
        if others[at : at + KEY] != key:
            break
        same += 1
    return same


def total_bytes(txn: lmdb.Transaction, meta: lmdb._Database) -> int:
    raw = txn.get(b"total_bytes", db=meta)
    assert raw is not None, "meta db lacks total_bytes: written at creation"
    return int(U64.unpack(raw)[0])


@dataclass(frozen=True, slots=True)
class RemovedKeys:
    """What the removal log says since a reader's position."""

    position: int  # where to read next
    keys: list[bytes]  # removed since, oldest first (a key may repeat)
    gap: bool  # entries were dropped before they were read: keys are missing


# -- the capacity ledger: total bytes and each tenant's (docs/decisions/0067) --

TENANT_USAGE = b"tenant/"  # meta: tenant/<8-byte digest> -> u64 bytes it holds
SHARES = b"shares"  # meta: the latest committer's shares, (tenant, u64 bytes)*
_SHARE = struct.Struct("<8sQ")


def pack_shares(shares: dict[bytes, int]) -> bytes:
    return b"".join(_SHARE.pack(t, n) for t, n in sorted(shares.items()))


def unpack_shares(raw: bytes | None) -> dict[bytes, int]:
    if not raw:
        return {}
    return {t: n for t, n in _SHARE.iter_unpack(bytes(raw))}


def prefixed(cursor: lmdb.Cursor, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """``(key less prefix, value)`` of the entries whose key starts with
    ``prefix``, in key order (one range of ``cursor``'s database)."""
    if not cursor.set_range(prefix):
        return
    for key, value in cursor:
        if not bytes(key).startswith(prefix):
            return
        yield bytes(key[len(prefix) :]), bytes(value)


def tenant_usage(txn: lmdb.Transaction, meta: lmdb._Database) -> dict[bytes, int]:
    """Each tenant's bytes, from the ledger (tenants holding nothing are absent)."""
    return {
        tenant: U64.unpack(raw)[0]
        for tenant, raw in prefixed(txn.cursor(db=meta), TENANT_USAGE)
    }


class Ledger:
    """The ledger within one write transaction: what it adds and takes per
    tenant, written once at its end (:meth:`write`)."""

    def __init__(self, txn: lmdb.Transaction, meta: lmdb._Database) -> None:
        self._txn, self._meta = txn, meta
        self.total = total_bytes(txn, meta)
        self._deltas: dict[bytes, int] = {}

    def add(self, tenant: bytes, nbytes: int) -> None:
        self.total += nbytes
        self._deltas[tenant] = self._deltas.get(tenant, 0) + nbytes

    def write(self) -> None:
        txn, meta = self._txn, self._meta
        txn.put(b"total_bytes", U64.pack(max(self.total, 0)), db=meta)
        for tenant, delta in self._deltas.items():
            if not delta:
                continue
            key = TENANT_USAGE + tenant
            raw = txn.get(key, db=meta)
            held = (U64.unpack(raw)[0] if raw is not None else 0) + delta
            if held > 0:
                txn.put(key, U64.pack(held), db=meta)
            elif raw is not None:
                txn.delete(key, db=meta)
