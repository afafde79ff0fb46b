"""The admission state of a cache directory, in the index's ``admission``
database: shared by every process on the directory, changed only inside the
index's write transactions (docs/decisions/0069).

Runs in: any process with a store handle, inside an :class:`.Index`
transaction it is given (this module opens none).

Keys of the database (``n`` is a table's one-byte name; key prefixes and
sequence numbers are u64 big-endian, so each table's order is byte order):

    n + b"k" + prefix -> seq [+ tag]  a table's members (the ghost tags a
                                      block declined: b"d")
    n + b"q" + seq    -> prefix       their order, oldest first
    n + b"#"          -> u64          its size
    b"seq"            -> u64          the last sequence number given out
    b"p" + process    -> 5 × f64, u64 a process's shadow scores (decayed hits
                                      and writes of each mode, asks) and when
                                      it wrote them
    b"bucket"         -> f64, u64     the write budget's bytes and their time
    b"c" + tenant + name -> u64       directory-wide counters per tenant

One table, ``g``: the directory's ghost of the blocks saves brought (what
second sight admits on), bounded by its caller's trim. The shadows
themselves live in the memory of each process that looks up, and run over
every process's sampled asks (the ask log, ``a`` + seq: the newest
:data:`ASK_LOG_ENTRIES` flushes); the directory's scores are the record of
the most asks among those written in the last :data:`STALE_S` seconds
(older records are dropped by the next writer). So the database holds at
most ``ghost_max`` entries, the ask log and one record per process,
whatever the traffic.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterable, Mapping

import lmdb

from npukv_store.store.admission import SCORES, Scores, TokenBucket

U64 = struct.Struct(">Q")
BUCKET = struct.Struct("<dQ")
GHOST = b"g"
PROCESS = b"p"
ASKS = b"a"  # + seq: one flush's sampled asks, u64 little-endian each
#: flushes of asks kept: a shadow further behind skips the rest
ASK_LOG_ENTRIES = 4096
STALE_S = 600.0  # a process's scores count this long after it wrote them
COUNTERS = (
    "admitted_blocks",
    "declined_blocks",
    "lost_hit_blocks",
    "wasted_write_blocks",
    "written_bytes",
)


class SeqCounter:
    """The database's sequence counter, read once per transaction."""

    def __init__(self, txn: lmdb.Transaction, db: lmdb._Database) -> None:
        raw = txn.get(b"seq", db=db)
        self.txn, self.db = txn, db
        self.value = U64.unpack(raw)[0] if raw else 0

    def next(self) -> int:
        self.value += 1
        return self.value

    def write(self) -> None:
        self.txn.put(b"seq", U64.pack(self.value), db=self.db)


class LmdbKeys:
    """One table as :class:`.admission.OrderedKeys`, in a write transaction."""

    def __init__(
        self, txn: lmdb.Transaction, db: lmdb._Database, name: bytes, seq: SeqCounter
    ) -> None:
        self.txn, self.db, self.seq = txn, db, seq
        self._k, self._q, self._n = name + b"k", name + b"q", name + b"#"
        raw = txn.get(self._n, db=db)
        self._size = U64.unpack(raw)[0] if raw else 0

    def __contains__(self, key: int) -> bool:
        return self.txn.get(self._k + U64.pack(key), db=self.db) is not None

    def __len__(self) -> int:
        return self._size

    def _resize(self, delta: int) -> None:
        self._size += delta
        self.txn.put(self._n, U64.pack(self._size), db=self.db)

    def push(self, key: int, tag: bytes = b"") -> None:
        member = self._k + U64.pack(key)
        old = self.txn.get(member, db=self.db)
        if old is not None:
            self.txn.delete(self._q + bytes(old)[: U64.size], db=self.db)
        seq = U64.pack(self.seq.next())
        self.txn.put(member, seq + tag, db=self.db)
        self.txn.put(self._q + seq, U64.pack(key), db=self.db)
        if old is None:
            self._resize(1)

    def discard(self, key: int) -> bool:
        member = self._k + U64.pack(key)
        old = self.txn.pop(member, db=self.db)
        if old is None:
            return False
        self.txn.delete(self._q + bytes(old)[: U64.size], db=self.db)
        self._resize(-1)
        return True

    def pop_oldest(self) -> int | None:
        cursor = self.txn.cursor(db=self.db)
        if not cursor.set_range(self._q) or not bytes(cursor.key()).startswith(self._q):
            return None
        key = bytes(cursor.value())
        cursor.delete()
        self.txn.delete(self._k + key, db=self.db)
        self._resize(-1)
        return int(U64.unpack(key)[0])


DECLINED = b"d"  # the ghost's tag of a block it holds because it was declined


def in_ghost(
    txn: lmdb.Transaction, db: lmdb._Database, prefixes: Iterable[int]
) -> list[bytes | None]:
    """Per key prefix, its tag in the directory's ghost (b"" or
    :data:`DECLINED`), or None where the ghost does not hold it (a read)."""
    member = GHOST + b"k"
    found = (txn.get(member + U64.pack(p), db=db) for p in prefixes)
    return [None if raw is None else bytes(raw)[U64.size :] for raw in found]


def publish_scores(
    txn: lmdb.Transaction,
    db: lmdb._Database,
    process: bytes,
    own: Scores | None,
    now_ns: int,
) -> Scores:
    """Record ``process``'s scores (None: unchanged), drop the records older
    than :data:`STALE_S`, and return the fresh record of the most asks:
    every process's shadow runs over the same ask log, so the views differ
    only in how long they have run, and a shadow that just started (a
    restart) does not send the directory back to its warm-up."""
    if own is not None:
        txn.put(PROCESS + process, own.pack() + U64.pack(now_ns), db=db)
    total, stale = _sum_scores(txn, db, now_ns)
    for key in stale:
        txn.delete(key, db=db)
    return total


def scores(txn: lmdb.Transaction, db: lmdb._Database, now_ns: int) -> Scores:
    """The directory's scores: the fresh record of the most asks (a read)."""
    return _sum_scores(txn, db, now_ns)[0]


def _sum_scores(
    txn: lmdb.Transaction, db: lmdb._Database, now_ns: int
) -> tuple[Scores, list[bytes]]:
    total = Scores()
    stale: list[bytes] = []
    cursor = txn.cursor(db=db)
    if not cursor.set_range(PROCESS):
        return total, stale
    for raw_key, raw in cursor.iternext():
        key = bytes(raw_key)
        if not key.startswith(PROCESS):
            break
        value = bytes(raw)
        if len(value) != SCORES.size + U64.size:
            stale.append(key)
            continue
        if now_ns - U64.unpack(value[SCORES.size :])[0] > STALE_S * 1e9:
            stale.append(key)
            continue
        found = Scores.unpack(value[: SCORES.size])
        if found.asks > total.asks:  # the view of the longest-running shadow
            total = found
    return total, stale


def append_asks(
    txn: lmdb.Transaction, db: lmdb._Database, prefixes: list[int], seq: SeqCounter
) -> None:
    """Append one flush's sampled asks to the shared log (one entry), and
    drop the oldest entries past :data:`ASK_LOG_ENTRIES`."""
    if not prefixes:
        return
    txn.put(
        ASKS + U64.pack(seq.next()), struct.pack(f"<{len(prefixes)}Q", *prefixes), db=db
    )
    size = txn.get(ASKS + b"#", db=db)
    count = (U64.unpack(size)[0] if size else 0) + 1
    cursor = txn.cursor(db=db)
    while count > ASK_LOG_ENTRIES and cursor.set_range(ASKS + bytes(U64.size)):
        if not bytes(cursor.key()).startswith(ASKS) or len(cursor.key()) != 9:
            break
        cursor.delete()
        count -= 1
    txn.put(ASKS + b"#", U64.pack(count), db=db)


def asks_since(
    txn: lmdb.Transaction, db: lmdb._Database, position: int
) -> tuple[list[int], int]:
    """Every process's sampled asks logged after ``position`` (a sequence
    number; 0: the whole log), in log order, and the new position."""
    out: list[int] = []
    cursor = txn.cursor(db=db)
    if not cursor.set_range(ASKS + U64.pack(position + 1)):
        return out, position
    for raw_key, raw in cursor.iternext():
        key = bytes(raw_key)
        if not key.startswith(ASKS) or len(key) != 1 + U64.size:
            break
        value = bytes(raw)
        out.extend(struct.unpack(f"<{len(value) // 8}Q", value))
        position = U64.unpack(key[1:])[0]
    return out, position


def bucket(txn: lmdb.Transaction, db: lmdb._Database, size: float) -> TokenBucket:
    """The write budget's bucket (full when none was recorded)."""
    raw = txn.get(b"bucket", db=db)
    if raw is None or len(raw) != BUCKET.size:
        return TokenBucket(size, 0)
    tokens, updated = BUCKET.unpack(raw)
    return TokenBucket(tokens, updated)


def write_bucket(txn: lmdb.Transaction, db: lmdb._Database, value: TokenBucket) -> None:
    txn.put(b"bucket", BUCKET.pack(value.tokens, value.updated_ns), db=db)


def add_counters(
    txn: lmdb.Transaction, db: lmdb._Database, deltas: Mapping[bytes, Mapping[str, int]]
) -> None:
    """Add per-tenant counter deltas (tenant -> name -> delta)."""
    for tenant, named in deltas.items():
        for name, delta in named.items():
            if not delta:
                continue
            key = b"c" + tenant + name.encode()
            raw = txn.get(key, db=db)
            txn.put(key, U64.pack((U64.unpack(raw)[0] if raw else 0) + delta), db=db)


def counters(txn: lmdb.Transaction, db: lmdb._Database) -> dict[bytes, dict[str, int]]:
    """tenant -> counter -> value, as recorded by every process."""
    out: dict[bytes, dict[str, int]] = {}
    cursor = txn.cursor(db=db)
    if not cursor.set_range(b"c"):
        return out
    for key, value in cursor.iternext():
        if not bytes(key).startswith(b"c"):
            break
        tenant, name = bytes(key[1:9]), bytes(key[9:]).decode()
        out.setdefault(tenant, {})[name] = U64.unpack(value)[0]
    return out


def table_sizes(txn: lmdb.Transaction, db: lmdb._Database) -> dict[str, int]:
    """Entries of the ghost, and process score records (for stats, and the
    tests' bound)."""
    raw = txn.get(GHOST + b"#", db=db)
    processes = 0
    cursor = txn.cursor(db=db)
    if cursor.set_range(PROCESS):
        for key in cursor.iternext(keys=True, values=False):
            if not bytes(key).startswith(PROCESS):
                break
            processes += 1
    logged = txn.get(ASKS + b"#", db=db)
    return {
        "ghost": U64.unpack(raw)[0] if raw else 0,
        "processes": processes,
        "ask_log": U64.unpack(logged)[0] if logged else 0,
    }


def report(txn: lmdb.Transaction, db: lmdb._Database) -> dict[str, object]:
    """The directory's admission state, for ``npukv stats``: the shadows'
    scores, the tables' sizes, the budget's bucket, the counters per tenant
    (hex of its 8-byte id)."""
    found = scores(txn, db, time.time_ns())
    raw = txn.get(b"bucket", db=db)
    budget = None
    if raw is not None and len(raw) == BUCKET.size:
        tokens, updated = BUCKET.unpack(raw)
        budget = {"tokens_bytes": tokens, "updated_ns": updated}
    return {
        "shadow_hits_all": found.hits_all,
        "shadow_hits_second_sight": found.hits_second_sight,
        "shadow_asks": found.asks,
        "shadow_writes_all": found.writes_all,
        "shadow_writes_second_sight": found.writes_second_sight,
        "tables": table_sizes(txn, db),
        "budget": budget,
        "tenants": {t.hex(): named for t, named in counters(txn, db).items()},
    }


def check(txn: lmdb.Transaction, db: lmdb._Database) -> list[str]:
    """What is inconsistent in the tables (empty: nothing): each member's
    order entry points back at it, and each recorded size is the count."""
    problems = []
    for name in (GHOST,):
        members: dict[bytes, bytes] = {}
        order: dict[bytes, bytes] = {}
        cursor = txn.cursor(db=db)
        for part, into in ((b"k", members), (b"q", order)):
            prefix = name + part
            if cursor.set_range(prefix):
                for key, value in cursor.iternext():
                    if not bytes(key).startswith(prefix):
                        break
                    into[bytes(key[2:])] = bytes(value)
        raw = txn.get(name + b"#", db=db)
        size = U64.unpack(raw)[0] if raw else 0
        label = name.decode()
        if not len(members) == len(order) == size:
            problems.append(
                f"table {label}: {len(members)} members, {len(order)} in order, "
                f"size {size}"
            )
        for key, seq in members.items():
            if order.get(seq[: U64.size]) != key:
                problems.append(f"table {label}: member {key.hex()} not in order")
                break
    return problems
