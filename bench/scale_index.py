"""bench_scale's index case: a 256-key chain lookup, an evicting commit and a
claim at growing key counts, warm and cold; bytes of index per key.

One index grows through the sizes (bulk-filled, bench/scale_fill.py: 7 rows
per chunk, sync off); at each size, on the real ``Index`` and ``ClaimTable``:

    lookup   ``Index.lookup_prefix`` of a 256-key chain of stored keys (37
             consecutive chunks), a fresh chain each call
    commit   ``Index.commit_chunk`` of a 7-row chunk with room (no eviction)
    evict    the same with the ledger full: the commit evicts the oldest chunk
             (both also as 4 KiB pages written per commit: where the time of
             a larger index goes, a B-tree path copied per key touched)
    claim    ``ClaimTable.claim`` of a 256-key chain and its release (the
             table holds only claims in flight, not the index's keys: its
             row shows the claim stays flat while the index grows)

Warm: p50 of calls after a few untimed ones. Cold: the page cache dropped
(``echo 3 > /proc/sys/vm/drop_caches``, root only; else each file's pages
are dropped with ``posix_fadvise(DONTNEED)`` once no process maps it), then
the p50 of the first calls, each on a fresh chain: the cost right after a
reboot. The index is opened unsynced: a synced commit adds an fsync whose
cost does not depend on the index's size (scale-review section 1).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench import scale_fill as fill
from bench.report import pct
from npukv_store.store.claims import ClaimTable
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord

CHAIN = 256
_CHAIN_CHUNKS = -(-CHAIN // fill.ROWS) + 1  # chunks a chain spans
MAP_SIZE = 16 << 30
_SALT_NEW = 1 << 40  # keys of measured commits: never among the bulk keys
_NS_NEW = b"\x02" * 16  # their namespace: a victim of another is a bulk chunk


def drop_page_cache(files: Sequence[str]) -> str:
    """Drop cached pages: all of them where permitted, else ``files``'.
    Returns how ("drop_caches" or "fadvise")."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def _p50_us(fn: Callable[[int], object], n: int, warmup: int) -> float:
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(warmup, warmup + n):
        t0 = time.perf_counter_ns()
        fn(i)
        times.append(time.perf_counter_ns() - t0)
    return pct(times, 0.5) / 1e3


class Grower:
    """One index under ``root``, grown through the sizes."""

    def __init__(self, root: str, calls: int, cold_calls: int, seed: int = 7) -> None:
        self.root = root
        self.index_path = os.path.join(root, "index")
        self.claims_path = os.path.join(root, "claims")
        os.makedirs(self.index_path, mode=0o700, exist_ok=True)
        self.calls, self.cold_calls = calls, cold_calls
        self.chunks = 0  # bulk chunks filled
        self.evicted = 0  # bulk chunks evicted by measured commits: 0.. (oldest)
        self.new_keys = 0
        self.fill_s = 0.0
        self.rnd = random.Random(seed)

    def grow(self, n_keys: int) -> None:
        target = -(-n_keys // fill.ROWS)
        if target > self.chunks:
            self.fill_s += fill.fill(
                self.index_path, self.chunks, target, map_size=MAP_SIZE
            )
            self.chunks = target

    def _chain(self) -> list[bytes]:
        start = self.rnd.randrange(self.evicted, self.chunks - _CHAIN_CHUNKS)
        return fill.keys(fill.ROWS * start, fill.ROWS * start + CHAIN)

    def _record(self) -> ChunkRecord:
        lo = self.new_keys
        self.new_keys += fill.ROWS
        now = time.time_ns()
        return ChunkRecord.new(
            (1 << 63) + lo, _NS_NEW, fill.keys(lo, lo + fill.ROWS, _SALT_NEW),
            fill.CHUNK_BYTES, now,
        )  # fmt: skip

    def measure(self, phase: str) -> dict[str, float]:
        """p50 µs of each operation at the current size; ``phase`` "warm" or
        "cold" (the caller dropped the page cache just before)."""
        index = Index(self.index_path, map_size=MAP_SIZE, sync=False)
        claims = ClaimTable(self.claims_path)
        try:
            if phase == "warm":
                fill.check_records(index, self.chunks, self.evicted)
            n, warmup = (self.calls, 5) if phase == "warm" else (self.cold_calls, 0)
            chains = [self._chain() for _ in range(n + warmup)]
            out = {"lookup_us": _p50_us(_lookup(index, chains), n, warmup)}
            claim_chains = [self._chain() for _ in range(n + warmup)]
            out["claim_release_us"] = _p50_us(_claim(claims, claim_chains), n, warmup)
            total = index.totals()[0]
            recs = [self._record() for _ in range(n + warmup)]
            written = _written_bytes()
            out["evict_commit_us"] = _p50_us(
                self._commit(index, recs, lambda: total), n, warmup
            )
            out["evict_commit_pages"] = _pages(written, n + warmup)
            if phase == "warm":
                recs = [self._record() for _ in range(n + warmup)]
                written = _written_bytes()
                out["commit_us"] = _p50_us(
                    self._commit(index, recs, lambda: 1 << 61), n, warmup
                )
                out["commit_pages"] = _pages(written, n + warmup)
            return out
        finally:
            claims.close()
            index.close()

    def _commit(
        self, index: Index, recs: list[ChunkRecord], capacity: Callable[[], int]
    ) -> Callable[[int], object]:
        def commit(i: int) -> None:
            res = index.commit_chunk(recs[i], capacity_bytes=capacity(), grace_ns=0)
            if res.live_rows != fill.ROWS:
                raise RuntimeError(f"measured commit won {res.live_rows} rows")
            # bulk chunks go oldest first: chunk 0, 1, ...
            self.evicted += sum(v.namespace != _NS_NEW for v in res.victims)

        return commit

    def index_bytes(self) -> dict[str, float]:
        """Bytes of index per key: pages in use and the file."""
        index = Index(self.index_path, map_size=MAP_SIZE, sync=False)
        try:
            _, chunks, n_keys = index.totals()
            env: Any = index._env  # the page counts LMDB keeps: no public view
            in_use = 0
            with env.begin() as txn:
                for name in (b"keys", b"chunks", b"lru", b"meta", b"dead"):
                    st = txn.stat(env.open_db(name, txn=txn, create=False))
                    pages = st["branch_pages"] + st["leaf_pages"]
                    in_use += (pages + st["overflow_pages"]) * st["psize"]
        finally:
            index.close()
        size = os.path.getsize(os.path.join(self.index_path, "data.mdb"))
        return {
            "keys": n_keys,
            "chunks": chunks,
            "in_use_bytes_per_key": in_use / max(n_keys, 1),
            "file_bytes_per_key": size / max(n_keys, 1),
        }


def _written_bytes() -> int:
    """Bytes this process passed to write calls so far (``wchar``): LMDB
    writes a commit's dirty pages with pwrite, so the change over commits is
    the pages they copied, the cost a B-tree's depth multiplies."""
    with open("/proc/self/io", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _pages(since: int, commits: int) -> float:
    return (_written_bytes() - since) / 4096 / max(commits, 1)


def _lookup(index: Index, chains: list[list[bytes]]) -> Callable[[int], object]:
    def lookup(i: int) -> None:
        found = index.lookup_prefix(chains[i])
        if found != CHAIN:
            raise RuntimeError(f"lookup found {found} of {CHAIN} stored keys")

    return lookup


def _claim(claims: ClaimTable, chains: list[list[bytes]]) -> Callable[[int], object]:
    def claim(i: int) -> None:
        won = claims.claim(chains[i])
        claims.release([k for k, w in zip(chains[i], won, strict=True) if w])

    return claim


def growth_exponent(sizes: Sequence[int], values: Sequence[float]) -> float:
    """The least-squares slope of log(value) over log(size): a cost that grows
    as N^e has exponent e (0: flat)."""
    xs = [math.log(s) for s in sizes]
    ys = [math.log(max(v, 1e-9)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return (
        sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den
        if den
        else 0.0
    )


def run_case(
    root: str, sizes: Sequence[int], calls: int, cold_calls: int
) -> dict[str, Any]:
    """Every size, warm then cold; the rows and the index's bytes per key."""
    grower = Grower(root, calls, cold_calls)
    rows, how = [], ""
    for n in sizes:
        grower.grow(n)
        warm = grower.measure("warm")
        files = [
            os.path.join(p, "data.mdb") for p in (grower.index_path, grower.claims_path)
        ]
        how = drop_page_cache(files)
        cold = grower.measure("cold")
        rows.append({"keys": n, "warm": warm, "cold": cold})
    return {
        "rows": rows,
        "cold_by": how,
        "fill_s": round(grower.fill_s, 2),
        "index": grower.index_bytes(),
    }
