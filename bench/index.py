"""Benchmark LMDB against SQLite (WAL mode) as npukv_store's shared block index.

Why: every vLLM request asks the index "how many leading blocks of this chain are
already stored?" before it schedules any NVMe read, so the lookup latency sits on
the request's critical path, and several worker processes ask it at once while one
writer keeps committing new chunks. The index backend must keep that lookup cheap
and steady under contention, and still commit fast enough for the writer.

Workload (identical logical content in both backends):
  keys    16-byte block key -> (chunk_id u64, row u32), struct '<QI'
  chunks  chunk_id -> size u64, n_rows u32, live_rows u32, last_access_ns u64,
          created_ns u64, ns 16 bytes, then n_rows * 16 bytes of keys
  lru     (last_access_ns big-endian u64, chunk_id) ordering
          (LMDB: its own named db; SQLite: an index on chunks.last_access)
  meta    total_bytes counter
A commit is one write transaction that inserts one chunk of 32 keys (a key row only
where the key is absent), its chunk record and LRU entry, and bumps total_bytes.

Measured, after populating 200k keys / 6250 chunks (50k keys with --quick):
  1. p50/p99 latency of one 256-key chain lookup (8 consecutive chunks; result =
     the locations of the longest stored prefix), single process, including the
     read-transaction begin/end of every lookup. Methods: LMDB txn.get loop, LMDB
     Cursor.getmulti (one C call), SQLite per-key SELECT, SQLite one
     "WHERE key IN (...)" query, plus a Python dict floor and an LMDB row with one
     read txn held across lookups (no begin/end; a lower bound only, since a held
     txn pins an old snapshot). py-lmdb already reuses read txns internally:
     commit/abort of a read txn calls mdb_txn_reset and the next begin() renews
     the cached handle, so begin() below is the reset()/renew() path (3.0.0 does
     not expose reset/renew on Transaction).
  2. The same lookups in one reader process while 3 more reader processes (same
     method) and 1 writer process (committing chunks back to back) run; all are
     spawned and open their own environment/connection.
  3. Commit throughput of the writer alone: LMDB sync=True/False, SQLite WAL
     synchronous=FULL/NORMAL.
Each contended case and each writer run works on a fresh copy of the populated
index, so writes from one case never change the tree another case reads.
Table columns: p50/p99 of one call (a chain lookup, or a commit for the writer
rows); ops/s = 1 / mean latency of the timed caller (lookups/s or chunks/s).

Run: ``python -m bench index [--quick] [--json PATH] [--dir PATH]``. JSON: the
report header (bench/report.py), ``system`` (library versions, the file
system), ``config``, ``results`` (the table's rows) and the LMDB/SQLite ratios.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import random
import shutil
import sqlite3
import struct
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Final

import lmdb
import numpy as np

from bench.report import Report, pct, table

KEY_BYTES = 16
ROWS_PER_CHUNK = 32
CHAIN_CHUNKS = 8  # 8 chunks x 32 rows = the 256-key chain
CHAIN_KEYS = CHAIN_CHUNKS * ROWS_PER_CHUNK
CHUNK_SIZE = ROWS_PER_CHUNK * (128 << 10)  # nominal NVMe bytes; only feeds "size"
NS = b"bench-namespace!"  # the 16-byte namespace field
SEED = 20240601
WARMUP = 50  # lookups discarded per timed run: cold pages, statement cache
LOC = struct.Struct("<QI")  # keys value: chunk_id, row
CID = struct.Struct(">Q")  # chunk key, big-endian: rising ids append at the tree end
LRU = struct.Struct(">QQ")  # big-endian so byte order == age order
CHUNK_HDR = struct.Struct("<QIIQQ16s")
TOTAL = struct.Struct("<Q")
# Measured on host vm (docs/RESULTS.md): buffers=True is slower for 12-16 byte
# items (a memoryview costs more to build than copying the bytes), so lookups use
# plain bytes.
LMDB_BUFFERS: Final = False

Loc = tuple[int, int]
Chunk = tuple[int, bytes]  # (chunk_id, ROWS_PER_CHUNK * KEY_BYTES bytes of keys)
Lookup = Callable[[Any, Sequence[bytes]], list[Loc]]
Row = dict[str, Any]


def split_keys(blob: bytes) -> list[bytes]:
    return [blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


def make_keys(n_keys: int) -> list[bytes]:
    """Deterministic keys, so spawned processes rebuild the same chains cheaply."""
    return split_keys(np.random.default_rng(SEED).bytes(n_keys * KEY_BYTES))


# --------------------------------------------------------------------------- LMDB
@dataclass
class LmdbIndex:
    env: lmdb.Environment
    keys: Any  # lmdb._Database is private, so it is not named here
    chunks: Any
    lru: Any
    meta: Any


def lmdb_open(path: str, durable: bool) -> LmdbIndex:
    env = lmdb.open(path, max_dbs=8, map_size=4 << 30, subdir=True, sync=durable)
    names = (b"keys", b"chunks", b"lru", b"meta")
    return LmdbIndex(env, *(env.open_db(n) for n in names))


def lmdb_commit(ix: LmdbIndex, chunks: Sequence[Chunk]) -> None:
    added = 0
    with ix.env.begin(write=True) as txn:
        for cid, blob in chunks:
            now = time.time_ns()
            rows = [(k, LOC.pack(cid, r)) for r, k in enumerate(split_keys(blob))]
            # overwrite=False: a key already stored keeps its older location.
            _, live = txn.cursor(ix.keys).putmulti(rows, overwrite=False)
            hdr = CHUNK_HDR.pack(CHUNK_SIZE, len(rows), live, now, now, NS)
            txn.put(CID.pack(cid), hdr + blob, db=ix.chunks)
            txn.put(LRU.pack(now, cid), b"", db=ix.lru)
            added += CHUNK_SIZE
        old = txn.get(b"total_bytes", db=ix.meta)
        total = (TOTAL.unpack(old)[0] if old else 0) + added
        txn.put(b"total_bytes", TOTAL.pack(total), db=ix.meta)


def _get_prefix(txn: lmdb.Transaction, keys: Sequence[bytes]) -> list[Loc]:
    out = []
    for k in keys:
        v = txn.get(k)
        if v is None:
            break
        out.append(LOC.unpack(v))
    return out


def _getmulti_prefix(txn: lmdb.Transaction, keys: Sequence[bytes]) -> list[Loc]:
    # getmulti returns the found (key, value) pairs in input order, skipping misses.
    pairs = txn.cursor().getmulti(keys)
    if len(pairs) == len(keys):  # full hit: no per-key comparison needed
        return [LOC.unpack(v) for _, v in pairs]
    out = []
    for (k, v), want in zip(pairs, keys, strict=False):
        if k != want:  # first key absent from the pairs ends the prefix
            break
        out.append(LOC.unpack(v))
    return out


def lmdb_get_loop(ix: LmdbIndex, keys: Sequence[bytes]) -> list[Loc]:
    with ix.env.begin(db=ix.keys, buffers=LMDB_BUFFERS) as txn:
        return _get_prefix(txn, keys)


def lmdb_getmulti(ix: LmdbIndex, keys: Sequence[bytes]) -> list[Loc]:
    with ix.env.begin(db=ix.keys, buffers=LMDB_BUFFERS) as txn:
        return _getmulti_prefix(txn, keys)


def lmdb_snapshot(ix: LmdbIndex, dst: str) -> None:
    os.makedirs(dst)
    ix.env.copy(dst, compact=True)


# ------------------------------------------------------------------------- SQLite
SCHEMA = """
CREATE TABLE keys(key BLOB PRIMARY KEY, chunk_id INTEGER NOT NULL,
                  row INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE chunks(chunk_id INTEGER PRIMARY KEY, size INTEGER, n_rows INTEGER,
                    live_rows INTEGER, last_access INTEGER, created INTEGER,
                    ns BLOB, keys BLOB);
CREATE INDEX chunks_lru ON chunks(last_access);
CREATE TABLE meta(k TEXT PRIMARY KEY, v INTEGER) WITHOUT ROWID;
INSERT INTO meta VALUES ('total_bytes', 0);
"""
SQL_ONE = "SELECT chunk_id, row FROM keys WHERE key = ?"


def sqlite_open(path: str, durable: bool, create: bool = False) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT ourselves, so the measured
    # transactions are exactly the ones written here.
    con = sqlite3.connect(path, isolation_level=None, timeout=60.0)
    if create:
        con.execute("PRAGMA journal_mode=WAL")  # persistent in the file
        con.executescript(SCHEMA)
    con.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
    # LMDB reads through its mmap; give SQLite the same chance instead of 2 MiB
    # of page cache plus pread() per miss.
    con.execute("PRAGMA mmap_size=1073741824")
    con.execute("PRAGMA cache_size=-65536")
    return con


def sqlite_commit(con: sqlite3.Connection, chunks: Sequence[Chunk]) -> None:
    added = 0
    con.execute("BEGIN IMMEDIATE")  # take the write lock now, not on first write
    try:
        for cid, blob in chunks:
            now = time.time_ns()
            rows = [(k, cid, r) for r, k in enumerate(split_keys(blob))]
            ins = "INSERT OR IGNORE INTO keys VALUES (?, ?, ?)"
            live = con.executemany(ins, rows).rowcount
            rec = (cid, CHUNK_SIZE, len(rows), live, now, now, NS, blob)
            con.execute("INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rec)
            added += CHUNK_SIZE
        con.execute("UPDATE meta SET v = v + ? WHERE k = 'total_bytes'", (added,))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def sqlite_per_key(con: sqlite3.Connection, keys: Sequence[bytes]) -> list[Loc]:
    out = []
    cur = con.cursor()
    cur.execute("BEGIN")  # one snapshot for the whole chain, like an LMDB read txn
    try:
        for k in keys:
            row = cur.execute(SQL_ONE, (k,)).fetchone()
            if row is None:
                break
            out.append(row)
    finally:
        cur.execute("COMMIT")
    return out


@lru_cache(maxsize=8)
def _in_sql(n: int) -> str:
    # Same text for the same n, so sqlite3's statement cache reuses the plan.
    return f"SELECT key, chunk_id, row FROM keys WHERE key IN ({','.join('?' * n)})"


def sqlite_batched(con: sqlite3.Connection, keys: Sequence[bytes]) -> list[Loc]:
    # One statement is one implicit read transaction; rows arrive in key order,
    # not chain order, so the prefix is rebuilt from a dict.
    found = {k: (c, r) for k, c, r in con.execute(_in_sql(len(keys)), keys)}
    out = []
    for k in keys:
        loc = found.get(k)
        if loc is None:
            break
        out.append(loc)
    return out


def sqlite_snapshot(con: sqlite3.Connection, dst: str) -> None:
    out = sqlite3.connect(dst, isolation_level=None)
    con.backup(out)
    # backup() copies pages, not the journal mode; switch the copy to WAL.
    mode = out.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    out.close()
    if mode != "wal":
        raise RuntimeError(f"snapshot {dst} is in {mode} mode, not wal")


# ------------------------------------------------------------------ dispatching
def open_index(kind: str, path: str, durable: bool = False) -> Any:
    return lmdb_open(path, durable) if kind == "lmdb" else sqlite_open(path, durable)


def close_index(kind: str, h: Any) -> None:
    (h.env if kind == "lmdb" else h).close()


def commit(kind: str, h: Any, chunks: Sequence[Chunk]) -> None:
    (lmdb_commit if kind == "lmdb" else sqlite_commit)(h, chunks)


def snapshot(kind: str, h: Any, dst: str) -> None:
    (lmdb_snapshot if kind == "lmdb" else sqlite_snapshot)(h, dst)


# (backend, case) -> lookup; these are the methods that take part in the verdict.
LOOKUPS: dict[tuple[str, str], Lookup] = {
    ("lmdb", "get loop"): lmdb_get_loop,
    ("lmdb", "getmulti"): lmdb_getmulti,
    ("sqlite", "per-key SELECT"): sqlite_per_key,
    ("sqlite", "IN (...) batch"): sqlite_batched,
}


# --------------------------------------------------------------------- measuring
def chain(keys: list[bytes], start: int) -> list[bytes]:
    return keys[start * ROWS_PER_CHUNK : (start + CHAIN_CHUNKS) * ROWS_PER_CHUNK]


def time_lookups(
    fns: Mapping[str, Callable[[Sequence[bytes]], list[Loc]]],
    keys: list[bytes],
    n: int,
    seed: int,
    deadline_s: float = math.inf,
) -> dict[str, list[int]]:
    """Latencies (ns) of n random chain lookups per method, after WARMUP untimed.

    Methods are interleaved call by call in a shuffled order, so drift in host
    speed (host vm is a shared VM) lands on all of them alike instead of on
    whichever ran during a slow spell. Each method draws its own chains, so none
    reads pages that another method warmed a moment before.
    """
    order = random.Random(seed)
    names = list(fns)
    rnds = {name: random.Random(seed + i) for i, name in enumerate(names)}
    last_start = len(keys) // ROWS_PER_CHUNK - CHAIN_CHUNKS
    stop_at = time.perf_counter() + deadline_s
    lat: dict[str, list[int]] = {name: [] for name in names}
    for i in range(n + WARMUP):
        order.shuffle(names)
        for name in names:
            ch = chain(keys, rnds[name].randint(0, last_start))
            t0 = time.perf_counter_ns()
            got = fns[name](ch)
            t1 = time.perf_counter_ns()
            if len(got) != CHAIN_KEYS:  # populated chains are always full hits
                raise RuntimeError(f"{name}: found {len(got)} of {CHAIN_KEYS} keys")
            if i >= WARMUP:
                lat[name].append(t1 - t0)
        if time.perf_counter() > stop_at:
            break
    return lat


def row(backend: str, case: str, phase: str, lat_ns: Sequence[int]) -> Row:
    a = np.asarray(lat_ns, dtype=np.float64) / 1e3
    return {
        "backend": backend,
        "case": case,
        "phase": phase,
        "n": int(a.size),
        "p50_us": round(pct(a.tolist(), 0.5), 2),
        "p99_us": round(pct(a.tolist(), 0.99), 2),
        "ops_s": round(1e6 / float(a.mean()), 1),
    }


def check_prefix_semantics(handles: dict[str, Any], keys: list[bytes]) -> None:
    """Every method must return the same prefix, also when the chain has a hole."""
    full = chain(keys, 3)
    holed = [*full[:100], b"\xff" * KEY_BYTES, *full[101:]]
    want = {
        n: [(3 + i // ROWS_PER_CHUNK, i % ROWS_PER_CHUNK) for i in range(n)]
        for n in (CHAIN_KEYS, 100)
    }
    for (kind, case), fn in LOOKUPS.items():
        for ch, n in ((full, CHAIN_KEYS), (holed, 100)):
            if fn(handles[kind], ch) != want[n]:
                raise RuntimeError(f"{kind} {case}: wrong prefix for {n}-key case")


# ------------------------------------------------------------ spawned processes
def reader_proc(
    kind: str,
    case: str,
    path: str,
    n_keys: int,
    seed: int,
    barrier: Any,
    stop: Any,
    measure: tuple[int, float] | None,
    out: Any,
) -> None:
    h = open_index(kind, path)
    keys = make_keys(n_keys)
    fn = LOOKUPS[(kind, case)]
    barrier.wait(timeout=120)
    if measure is None:  # background load: same method until told to stop
        rnd = random.Random(seed)
        last_start = n_keys // ROWS_PER_CHUNK - CHAIN_CHUNKS
        while not stop.is_set():
            fn(h, chain(keys, rnd.randint(0, last_start)))
    else:
        n, deadline = measure
        lat = time_lookups({case: partial(fn, h)}, keys, n, seed, deadline)
        stop.set()
        out.put(("reader", lat[case]))
    close_index(kind, h)


def writer_proc(
    kind: str,
    path: str,
    durable: bool,
    first_cid: int,
    barrier: Any,
    stop: Any,
    duration_s: float,
    out: Any,
) -> None:
    h = open_index(kind, path, durable)
    rnd = random.Random(first_cid)
    if barrier is not None:
        barrier.wait(timeout=120)
    lat: list[int] = []
    t_end = time.perf_counter() + duration_s
    cid = first_cid
    while not (stop is not None and stop.is_set()) and time.perf_counter() < t_end:
        ch = (cid, rnd.randbytes(ROWS_PER_CHUNK * KEY_BYTES))
        t0 = time.perf_counter_ns()
        commit(kind, h, [ch])
        lat.append(time.perf_counter_ns() - t0)
        cid += 1
    close_index(kind, h)
    out.put(("writer", lat))


def run_procs(
    procs: list[Any], out: Any, n_results: int, timeout: float, stop: Any = None
) -> dict[str, list[int]]:
    for p in procs:
        p.start()
    try:
        # Drain the queue before join(): a child blocks on exit until its
        # queued data is consumed.
        return dict(out.get(timeout=timeout) for _ in range(n_results))
    finally:
        if stop is not None:  # release background readers if the measured one died
            stop.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()


# --------------------------------------------------------------------- phases
@dataclass
class Config:
    n_keys: int
    n_lookups: int
    n_contended: int
    contended_deadline_s: float
    contended_rounds: int  # rounds alternate the case order; samples are pooled
    writer_s: float


FULL = Config(200_000, 3000, 1000, 6.0, 2, 4.0)
QUICK = Config(50_000, 500, 400, 2.0, 1, 1.0)


def populate(kind: str, h: Any, keys: list[bytes]) -> float:
    """Bulk-load with the commit code path, 250 chunks per txn to skip fsyncs."""
    blob = b"".join(keys)
    per = ROWS_PER_CHUNK * KEY_BYTES
    chunks = [
        (i, blob[i * per : (i + 1) * per]) for i in range(len(keys) // ROWS_PER_CHUNK)
    ]
    t0 = time.perf_counter()
    for i in range(0, len(chunks), 250):
        commit(kind, h, chunks[i : i + 250])
    return time.perf_counter() - t0


def phase_single(handles: dict[str, Any], keys: list[bytes], cfg: Config) -> list[Row]:
    d = {k: (i // ROWS_PER_CHUNK, i % ROWS_PER_CHUNK) for i, k in enumerate(keys)}

    def dict_lookup(ch: Sequence[bytes]) -> list[Loc]:
        out = []
        for k in ch:
            loc = d.get(k)
            if loc is None:
                break
            out.append(loc)
        return out

    ix = handles["lmdb"]
    # Extra method: one read txn held across all lookups, i.e. no begin/end.
    held = ix.env.begin(db=ix.keys, buffers=LMDB_BUFFERS)
    fns = {"dict|in-process baseline": dict_lookup}
    fns |= {f"{k}|{c}": partial(fn, handles[k]) for (k, c), fn in LOOKUPS.items()}
    fns["lmdb|getmulti, held txn (extra)"] = partial(_getmulti_prefix, held)
    try:
        lat = time_lookups(fns, keys, cfg.n_lookups, SEED)
    finally:
        held.abort()
    rows = []
    for name, samples in lat.items():
        kind, case = name.split("|")
        rows.append(row(kind, case, "single", samples))
    return rows


def phase_contended(
    handles: dict[str, Any], cfg: Config, root: str, ctx: Any
) -> list[Row]:
    lat: dict[tuple[str, str], list[int]] = {kc: [] for kc in LOOKUPS}
    wlat: dict[tuple[str, str], list[int]] = {kc: [] for kc in LOOKUPS}
    cases = list(LOOKUPS)
    for rnd in range(cfg.contended_rounds):
        for i, (kind, case) in enumerate(cases if rnd % 2 == 0 else cases[::-1]):
            path = os.path.join(root, f"contended{rnd}_{i}.{kind}")
            snapshot(kind, handles[kind], path)
            res = contended_case(kind, case, path, cfg, SEED + 10 * rnd, ctx)
            lat[(kind, case)] += res["reader"]
            wlat[(kind, case)] += res["writer"]
    rows = []
    for (kind, case), samples in lat.items():
        r = row(kind, case, "contended", samples)
        wl = wlat[(kind, case)]
        r["writer_chunks_s"] = round(len(wl) / (sum(wl) / 1e9), 1) if wl else 0.0
        rows.append(r)
    return rows


def contended_case(
    kind: str, case: str, path: str, cfg: Config, seed: int, ctx: Any
) -> dict[str, list[int]]:
    """One measured reader + 3 background readers + 1 writer on one index copy."""
    barrier, stop, out = ctx.Barrier(5), ctx.Event(), ctx.Queue()
    measure = (cfg.n_contended, cfg.contended_deadline_s)
    procs = [
        ctx.Process(
            target=reader_proc,
            args=(
                kind,
                case,
                path,
                cfg.n_keys,
                seed + r,
                barrier,
                stop,
                measure if r == 0 else None,
                out,
            ),
        )
        for r in range(4)
    ]
    # Writer without per-commit fsync: it never sleeps in fsync, so readers see
    # the most CPU and lock pressure a writer can create.
    procs.append(
        ctx.Process(
            target=writer_proc,
            args=(kind, path, False, 1 << 32, barrier, stop, math.inf, out),
        )
    )
    return run_procs(procs, out, 2, cfg.contended_deadline_s + 120, stop)


def phase_writer(
    handles: dict[str, Any], cfg: Config, root: str, ctx: Any
) -> list[Row]:
    rows = []
    configs = [
        ("lmdb", True, "commit sync=True"),
        ("lmdb", False, "commit sync=False"),
        ("sqlite", True, "commit synchronous=FULL"),
        ("sqlite", False, "commit synchronous=NORMAL"),
    ]
    for i, (kind, durable, case) in enumerate(configs):
        path = os.path.join(root, f"writer{i}.{kind}")
        snapshot(kind, handles[kind], path)
        out = ctx.Queue()
        p = ctx.Process(
            target=writer_proc,
            args=(kind, path, durable, 1 << 32, None, None, cfg.writer_s, out),
        )
        res = run_procs([p], out, 1, timeout=cfg.writer_s + 120)
        rows.append(row(kind, case, "writer alone", res["writer"]))
    return rows


# ----------------------------------------------------------------- reporting
def fs_type(path: str) -> str:
    best = ("", "?")
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fs = line.split()[:3]
            if path.startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, fs)
    return f"{best[1]} on {best[0]}"


def system_facts(root: str) -> dict[str, Any]:
    """What the header does not say: usable CPUs, versions, the file system."""
    return {
        "cpus_usable": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "py_lmdb": lmdb.__version__,
        "lmdb_c": ".".join(map(str, lmdb.version())),
        "sqlite": sqlite3.sqlite_version,
        "bench_fs": fs_type(os.path.realpath(root)),
    }


def ratio(rows: list[Row], phase: str, stat: str) -> dict[str, Any]:
    """Best LMDB method over best SQLite method (< 1 means LMDB is faster)."""
    best = {}
    for kind in ("lmdb", "sqlite"):
        cands = [
            r
            for r in rows
            if r["phase"] == phase
            and r["backend"] == kind
            and (kind, r["case"]) in LOOKUPS
        ]
        best[kind] = min(cands, key=lambda r: r[stat])
    value = round(best["lmdb"][stat] / best["sqlite"][stat], 3)
    return {
        "value": value,
        "lmdb": best["lmdb"]["case"],
        "sqlite": best["sqlite"]["case"],
    }


def print_table(rows: list[Row]) -> None:
    lines: list[list[str]] = []
    phase = None
    for r in rows:
        if r["phase"] != phase:
            phase = r["phase"]
            lines.append([f"[{phase}]"])
        case = r["case"]
        if "writer_chunks_s" in r:
            case += f" (wr {r['writer_chunks_s']:.0f}/s)"
        lines.append(
            [r["backend"], case, f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}",
             f"{r['ops_s']:.1f}"]
        )  # fmt: skip
    print(table(["backend", "case", "p50 us", "p99 us", "ops/s"], lines, "<<>>>"))


def measure(cfg: Config, root: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    keys = make_keys(cfg.n_keys)
    handles: dict[str, Any] = {
        "lmdb": lmdb_open(os.path.join(root, "main.lmdb"), durable=False),
        "sqlite": sqlite_open(os.path.join(root, "main.sqlite"), False, create=True),
    }
    try:
        populate_s = {k: round(populate(k, h, keys), 2) for k, h in handles.items()}
        check_prefix_semantics(handles, keys)
        env = handles["lmdb"].env
        sizes = {
            "lmdb": (env.info()["last_pgno"] + 1) * env.stat()["psize"],
            "sqlite": os.path.getsize(os.path.join(root, "main.sqlite")),
        }
        rows = phase_single(handles, keys, cfg)
        rows += phase_contended(handles, cfg, root, ctx)
        rows += phase_writer(handles, cfg, root, ctx)
    finally:
        for kind, h in handles.items():
            close_index(kind, h)
    return {
        "system": system_facts(root),
        "config": {
            **cfg.__dict__,
            "chain_keys": CHAIN_KEYS,
            "rows_per_chunk": ROWS_PER_CHUNK,
            "warmup": WARMUP,
            "lmdb_buffers": LMDB_BUFFERS,
            "contended": "1 measured + 3 background readers, 1 writer "
            "(lmdb sync=False / sqlite synchronous=NORMAL)",
        },
        "populate_s": populate_s,
        "index_bytes": sizes,
        "results": rows,
        "lmdb_over_sqlite_lookup_p50": ratio(rows, "single", "p50_us")["value"],
        "lmdb_over_sqlite_lookup_p50_contended": ratio(rows, "contended", "p50_us")[
            "value"
        ],
        "ratio_detail": {
            f"{ph}_{st}": ratio(rows, ph, st)
            for ph in ("single", "contended")
            for st in ("p50_us", "p99_us")
        },
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        metavar="PATH",
        default="/tmp",
        help="parent of the temporary index dir (default /tmp)",
    )


def run(args: argparse.Namespace) -> Report:
    """The whole run (``--quick``: 50k keys, about a minute)."""
    report = Report(args)
    cfg = QUICK if args.quick else FULL
    root = tempfile.mkdtemp(prefix="bench_index_", dir=args.dir)
    t0 = time.perf_counter()
    try:
        report.data = measure(cfg, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    data = report.data
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    print_table(data["results"])
    print(
        f"\nlmdb/sqlite best p50, single: {data['lmdb_over_sqlite_lookup_p50']}"
        f"  contended: {data['lmdb_over_sqlite_lookup_p50_contended']}"
        f"  (wall {data['wall_s']} s, {report.header['cpus']} cpus)"
    )
    return report
