"""Tenants: what an evicting commit costs as the tenants of a directory grow.

Eviction reads the head of each tenant over its share (one cursor seek per
tenant, docs/decisions/0067), so its cost grows with the tenants it must
compare. One index per case, filled with ``--keys`` keys in 7-row chunks
spread evenly over its tenants (bulk, through the index's own publish),
then ``--calls`` commits of a 7-row chunk with the ledger full (each evicts
the oldest chunk over its share), warm, p50 and pages written per commit.
The baseline is one tenant in the same run (the directory without
tenant_shares); the cases are 4, 16 and 64 tenants all over their share
(every head compared), and 64 tenants of which 63 are under a share (one
head compared: a reservation costs nothing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench.report import Report, pct, ratio, table
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord, Ledger

ROWS = 7
CHUNK_BYTES = 7 * 64 << 10
NS = b"\x01" * 16


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=int, default=100_000, help="keys per index")
    parser.add_argument("--calls", type=int, default=300, help="timed commits")
    parser.add_argument("--dir", default=None, help="where the indexes go")


def _tenant(i: int) -> bytes:
    return (i + 1).to_bytes(8, "big")


def _key(i: int, salt: int = 0) -> bytes:
    return (salt << 64 | i).to_bytes(16, "big")


def _fill(index: Index, chunks: int, tenants: int) -> None:
    """``chunks`` chunks round-robin over ``tenants``, oldest first."""
    step = 2000
    for lo in range(0, chunks, step):
        with index._env.begin(write=True) as txn:  # bulk: see bench/index_fill.py
            ledger = Ledger(txn, index._meta)
            for c in range(lo, min(lo + step, chunks)):
                keys = [_key(c * ROWS + r) for r in range(ROWS)]
                record = ChunkRecord.new(
                    c + 1, NS, keys, CHUNK_BYTES, c + 1, _tenant(c % tenants)
                )
                index._publish_in(txn, record)
                ledger.add(record.tenant, CHUNK_BYTES)
            ledger.write()


def _measure(root: str, keys: int, calls: int, tenants: int, reserved: bool) -> dict:
    index = Index(root, map_size=4 << 30, sync=False)
    try:
        chunks = keys // ROWS
        _fill(index, chunks, tenants)
        capacity = chunks * CHUNK_BYTES
        shares = {}
        if reserved:  # every tenant but the committer's holds a reservation
            held = capacity // tenants
            shares = {_tenant(i): held + CHUNK_BYTES for i in range(1, tenants)}
        times = []
        written = _wchar()
        for call in range(calls + 20):
            keys_new = [_key(call * ROWS + r, salt=1) for r in range(ROWS)]
            record = ChunkRecord.new(
                10**9 + call, NS, keys_new, CHUNK_BYTES, 10**12 + call, _tenant(0)
            )
            begin = time.perf_counter()
            result = index.commit_chunk(
                record, capacity_bytes=capacity, grace_ns=0, shares=shares
            )
            elapsed = time.perf_counter() - begin
            if result.rejected or not result.victims:
                raise RuntimeError(f"commit {call} did not evict: {result}")
            if call == 19:
                written = _wchar()
            if call >= 20:
                times.append(elapsed * 1e6)
        pages = (_wchar() - written) / 4096 / calls
    finally:
        index.close()
    return {"p50_us": pct(times, 0.5), "p90_us": pct(times, 0.9), "pages": pages}


def _wchar() -> int:
    with open(f"/proc/{os.getpid()}/io") as handle:
        for line in handle:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def run(args: argparse.Namespace) -> Report:
    report = Report(args)
    keys = 20_000 if args.quick else args.keys
    calls = 100 if args.quick else args.calls
    cases = [(1, False), (4, False), (16, False), (64, False), (64, True)]
    results = []
    # a first, untimed case: the first index of a process pays for the
    # allocator and page-cache warm-up, which would flatter every later case
    for tenants, reserved in [(1, False), *cases]:
        root = tempfile.mkdtemp(prefix="bench_tenants_", dir=args.dir)
        try:
            found = _measure(root, keys, calls, tenants, reserved)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        results.append({"tenants": tenants, "reserved": reserved, **found})
    results = results[1:]
    base = results[0]["p50_us"]
    rows = []
    for row in results:
        row["ratio"] = ratio(row["p50_us"], base)
        what = f"{row['tenants']}" + (" (63 under a share)" if row["reserved"] else "")
        rows.append(
            (what, f"{row['p50_us']:.1f}", f"{row['p90_us']:.1f}",
             f"{row['pages']:.2f}", f"{row['ratio']:.2f}")
        )  # fmt: skip
    print(f"evicting commit of a {ROWS}-row chunk, {keys} keys, {calls} calls, warm")
    print(table(("tenants", "p50 us", "p90 us", "pages", "x 1 tenant"), rows))
    report.data = {"keys": keys, "calls": calls, "rows_per_chunk": ROWS,
                   "cases": results}  # fmt: skip
    return report
