"""The bytes of the index's rows: the fixed layouts of its LMDB values and
the record of a published chunk. :mod:`.index` keeps them in LMDB; this module
says what each value holds (docs/decisions/0060 for row 0's list).

    ChunkRecord  - one published chunk: namespace, size, rows, LRU times, keys
    CommitResult - what a commit did: rows won, whether refused, victims
    whole_home() - row 0's keys db value in a chunk whose rows are all home
    listed_run() - how many keys of a chain row 0's list vouches for
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb

LOC_FMT = struct.Struct("<QI")  # keys db value: chunk id, row
REC_FMT = struct.Struct("<16sQIIQQ")  # ns, size, rows, live rows, last ns, created ns
LRU_FMT = struct.Struct(">QQ")  # big-endian so byte order is time order
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

    @classmethod
    def new(
        cls,
        chunk_id: int,
        namespace: bytes,
        keys: Sequence[bytes],
        size_bytes: int,
        created_ns: int,
    ) -> ChunkRecord:
        """The record of a chunk about to be committed (rows not yet won)."""
        return cls(
            chunk_id, namespace, size_bytes, len(keys), 0, created_ns, created_ns,
            tuple(keys),
        )  # fmt: skip

    def pack(self) -> bytes:
        head = REC_FMT.pack(
            self.namespace,
            self.size_bytes,
            self.num_rows,
            self.live_rows,
            self.last_access_ns,
            self.created_ns,
        )
        return head + b"".join(self.keys)

    @classmethod
    def unpack(cls, chunk_id: int, raw: bytes | memoryview) -> ChunkRecord:
        ns, size, rows, live, last, created = REC_FMT.unpack_from(raw)
        blob = bytes(raw[REC_FMT.size :])
        keys = tuple(blob[i : i + 16] for i in range(0, len(blob), 16))
        return cls(chunk_id, ns, size, rows, live, last, created, keys)


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
