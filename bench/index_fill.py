"""Bulk-build a real :class:`~npukv_store.store.index.Index` of N keys, fast.

Why: the index's growth (issue 27) is measured at 10^4 to 10^7 keys, and
publishing 10^7 keys one synced commit at a time takes hours. This writes the
same databases a run of ``commit_chunk`` calls would (keys, chunk records, LRU,
ledger), through the index's own ``_publish_in``, many chunks per write
transaction, on an index opened with ``sync=False``.

Layout: key ``i`` is ``xxh3_128(seed, i)``; chunk ``j`` holds keys
``j*rows .. j*rows+rows-1`` in that order (one prompt's blocks saved as
consecutive chunks), has a random-looking 63-bit id, as the store's
``secrets.randbits(63) + 1`` does, and was last used at ``base_ns + j`` (so the
LRU's oldest chunk is chunk 0).

    fill_index()  - build the index; returns a FilledIndex
    FilledIndex   - key(i), chain(start, length), chunk_id(j), next_record()

Used by bench/scale.py; run alone: ``python -m bench.index_fill DIR N``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import xxhash

from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord, Ledger

NAMESPACE = b"\x01" * 16
BASE_NS = 1_000_000_000_000_000_000  # far from now: touches in a bench stay younger


@dataclass(frozen=True)
class FilledIndex:
    """What :func:`fill_index` built, and how to name its keys and chunks."""

    num_keys: int
    rows_per_chunk: int
    chunk_bytes: int
    seed: bytes
    build_s: float

    @property
    def num_chunks(self) -> int:
        return -(-self.num_keys // self.rows_per_chunk)

    def key(self, i: int) -> bytes:
        return xxhash.xxh3_128_digest(i.to_bytes(8, "little"), seed=_seed(self.seed))

    def chain(self, start: int, length: int) -> list[bytes]:
        """Keys ``start .. start+length-1`` (stored in that order, in chunks)."""
        return [self.key(i) for i in range(start, start + length)]

    def chunk_id(self, j: int) -> int:
        raw = xxhash.xxh64_intdigest(j.to_bytes(8, "little"), seed=_seed(self.seed))
        return (raw >> 1) or 1  # non-zero, 63 bits, as the store's ids

    def record(self, j: int, keys: list[bytes] | None = None) -> ChunkRecord:
        """Chunk ``j``'s record (``keys`` for a chunk not from the fill)."""
        if keys is None:
            first = j * self.rows_per_chunk
            keys = self.chain(first, min(self.rows_per_chunk, self.num_keys - first))
        return ChunkRecord.new(
            self.chunk_id(j), NAMESPACE, keys, self.chunk_bytes, BASE_NS + j
        )


def _seed(seed: bytes) -> int:
    return xxhash.xxh64_intdigest(seed)


def fill_index(
    index: Index,
    num_keys: int,
    *,
    rows_per_chunk: int = 7,
    chunk_bytes: int = 1 << 20,
    chunks_per_txn: int = 4096,
    seed: bytes = b"npukv-fill",
) -> FilledIndex:
    """Publish ``num_keys`` keys into an empty ``index`` (open it with
    ``sync=False`` and a map size of about 300 bytes per key or more).

    At 10^6 keys this took about 20 s on the 2-core VM; 10^7 about ten times
    that (random inserts into a B-tree larger than the CPU caches).
    """
    started = time.perf_counter()
    spec = FilledIndex(num_keys, rows_per_chunk, chunk_bytes, seed, 0.0)
    for first in range(0, spec.num_chunks, chunks_per_txn):
        last = min(first + chunks_per_txn, spec.num_chunks)
        records = [spec.record(j) for j in range(first, last)]
        with index._env.begin(write=True) as txn:
            ledger = Ledger(txn, index._meta)  # the total and each tenant's part
            for record in records:
                if index._publish_in(txn, record):
                    ledger.add(record.tenant, record.size_bytes)
            ledger.write()
    return FilledIndex(
        num_keys, rows_per_chunk, chunk_bytes, seed, time.perf_counter() - started
    )


def main(argv: list[str]) -> None:
    path, num_keys = argv[0], int(float(argv[1]))
    index = Index(path, map_size=max(1 << 30, num_keys * 400), sync=False)
    filled = fill_index(index, num_keys)
    total, chunks, keys = index.totals()
    print(f"{keys} keys, {chunks} chunks, {total} bytes in {filled.build_s:.1f} s")
    index.close()


if __name__ == "__main__":
    main(sys.argv[1:])
