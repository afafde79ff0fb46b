"""Benchmark KVStore put/read against the disk's own limit and two simpler stores.

Why: the store sits between vLLM's KV cache and a local disk. It only earns its
keep if a put costs about what writing the same bytes to one file costs, and a
read about what reading them back costs; the chunk format, checksums, index and
crash safety must not eat the disk's bandwidth.

Every case moves the same bytes: one random payload buffer of ``--total-mib`` MiB,
written and read back in batches of 64 MiB. Measured in one run:

  raw       one big file: ``os.write`` of 8 MiB pieces, one ``fsync`` at the end
            (the disk's limit); read back with ``os.preadv`` of 8 MiB pieces into
            one preallocated 64 MiB buffer, buffered and (cold only) with
            O_DIRECT. Extra write rows: fsync every 64 MiB (a chunk put's fsync
            granularity), and early writeback (``sync_file_range`` after each
            piece, as the store does per layer). The faster of the two
            full-file raw writes, and of the two cold raw reads, is "the disk's
            limit" (the store reads uncached chunks with O_DIRECT, so a
            buffered-only baseline would understate the disk).
  ours      ``KVStore.put`` of 64 MiB chunks (32 blocks of 2 MiB or 128 of
            512 KiB: 32 layers x parts k,v of F16 ``[16, heads, 128]``) with
            ``fsync="chunk"`` (file fsync, rename, dir fsync, index commit with
            sync); ``KVStore.read`` of the same batches into preallocated ``out``
            arrays, checksums verified (``verify="always"``, the default). An
            extra read row re-reads the 2 MiB chunks with ``verify="never"``:
            the difference is what the checksums cost.
  ours/1    the same 2 MiB chunks read by one ``KVStore.read`` of every key
            into one payload-sized buffer (a fresh handle, so its first read is
            O_DIRECT again): the shape of a connector load (one call over the
            whole prefix, however many chunks it spans) and of the raw read
            (one stream over the file). The store reads two chunks at once in
            such a call. ``read_cold_ratio``/``read_warm_ratio`` and the read
            comparisons with safetensors and LMDB in ``targets_met`` are this
            row's: a load is one call; the per-64 MiB-call figures are in the
            JSON too (``read_cold_ratio_per_batch``,
            ``read_warm_ratio_per_batch``, ``per_batch_read_cold_faster``).
  ours/buf  the ``ours/1`` read with ``direct_io=false``: cold, every layer
            is read buffered. By the store's rule (docs/decisions/0019) these
            1 MiB segments go through the engine, 16 requests in flight; a
            second row streams every layer (one thread, file order, kernel
            readahead), as the store does for segments over 4 MiB.
            ``read_cold_ratio_buffered`` is the first over the raw limit;
            ``buffered_cold_stream_over_default`` is the second over the
            first, to tell on each disk which one it prefers.
  st/block  one safetensors file per 2 MiB block (vLLM ExampleConnector style):
            ``save_file`` + fsync of each file + one dir fsync per 64 MiB; read
            with ``load_file`` and copied into the preallocated buffer.
  lmdb      one LMDB env as a blob store: 16-byte key -> the 2 MiB block,
            ``sync=True``, ``writemap=False``, one commit per 64 MiB; read with
            ``txn.get`` (buffers=True) copied into the preallocated buffer.
  lookup    ``KVStore.lookup`` of a fully stored 256-key chain (its own small
            store, 320 keys in chunks of 32): p50/p99 in us over 2000 calls
            (500 with --quick), once before and once after the I/O rounds; the
            round with the better p50 is reported.

Reads are measured cold (page cache dropped just before, see
``cache_drop_method``) and warm (right after the cold read). Each read row also
reports the process CPU seconds per GB of its least-CPU round (``CPU s/GB``,
JSON ``<case>_cpu_s_per_gb``): the store reads with several threads and
verifies every byte, so it spends more CPU per byte than LMDB's one-thread
copy, and on a VM whose host takes back CPU time (``cpu_steal_share``, from
/proc/stat over the run) its warm reads lose the cores they count on. On a virtual disk
"cold" only empties the guest's cache; the host may still hold the data.

Reading the table: GB/s counts payload bytes only (headers, checksums and index
are overhead, not throughput). "ratio" is the case's GB/s over the fastest raw
variant's GB/s in the same direction and cache state (write vs raw write, cold
read vs raw cold read, warm vs warm): 1.0 means the disk limit, 0.8 means 20%
lost to the store. Each
case runs ``--rounds`` times (at least 2), interleaved with raw and in reversed
order every other round, and the best round is reported: timings on a shared
disk are noisy, and the best round is the least disturbed one.

Ratios divide best by best (each case's best round). The "raw file, fsync/64MiB"
row is the floor a chunk store with one fsync per chunk can reach; the gap from
it to "ours write" is the store's own cost (checksums, header, rename, dir fsync,
index commit). The JSON holds every GB/s and ratio (``<case>_<block>_<op>_gbps``
and ``_ratio``), the headline ``write_ratio``/``read_cold_ratio``/
``read_warm_ratio`` (ours 2 MiB vs raw), lookup p50/p99 and ``targets_met``.

Run: ``python -m bench store [--quick] [--json PATH] [--dir PATH]
[--total-mib N] [--rounds N] [--profile]``; ``--profile`` adds a cProfile of
one 2 MiB put pass and one cold read pass. JSON: the report header
(bench/report.py), then the keys above.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import lmdb
import numpy as np
from safetensors.numpy import load_file, save_file

from bench import ROOT
from bench.host import cpu_ticks, steal_share
from bench.io import measure_calibration
from bench.report import Report, gbps, pct, table
from npukv_store.cli.render import calibration_text
from npukv_store.config import StoreConfig
from npukv_store.io.direct import aligned_buffer, open_direct
from npukv_store.native import sync_file_range_write
from npukv_store.spec import LayerSpec, NamespaceSpec, PartSpec
from npukv_store.store import KVStore, calibration
from npukv_store.store.calibration import Calibration
from npukv_store.store.read.plan import ReadTuning

MIB = 1 << 20
BATCH_BYTES = 64 * MIB  # one chunk / one LMDB commit / one fsync group
RAW_PIECE = 8 * MIB  # raw write and read size per syscall
LAYERS = 32
TOKENS = 16
HEAD_DIM = 128
BLOCK_HEADS = {2 * MIB: 8, 512 << 10: 2}  # 32 x 2 x 16*heads*128*2 bytes
SEED = 20240601
LOOKUP_CHAIN = 256
LOOKUP_STORED = 320  # stored keys: the chain plus a tail
LOOKUP_WARMUP = 50
DROP_CACHES = "/proc/sys/vm/drop_caches"
WRITE, COLD, WARM = "write", "read cold", "read warm"
OPS = (WRITE, COLD, WARM)  # table order


@dataclass(frozen=True)
class Case:
    """One benchmark row: who, what block size, which direction/cache state."""

    name: str
    block: int  # bytes per block; 0 for raw (no blocks)
    op: str

    @property
    def key(self) -> str:
        """JSON key prefix, e.g. ``ours_2m_read_cold``."""
        size = "" if not self.block else f"_{_size_label(self.block).lower()}"
        return f"{self.name}{size}_{self.op.replace(' ', '_')}"


@dataclass
class Context:
    """What every case needs: the payload, the scratch buffer, the round dir."""

    payload: np.ndarray  # uint8 [total]
    out: np.ndarray  # uint8 [BATCH_BYTES], preallocated and pre-touched
    out_all: np.ndarray  # uint8 [total], for the one-call read
    root: Path
    drop_method: str
    check: bool  # compare read bytes with the payload (untimed)
    #: per read case, the least process CPU seconds (all threads) of a round
    cpu: dict[Case, float] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return int(self.payload.size)

    def batches(self) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, self.total, BATCH_BYTES):
            yield start, self.payload[start : start + BATCH_BYTES]

    def verify(self, batch: np.ndarray, what: str) -> None:
        if self.check and not np.array_equal(self.out[: batch.size], batch):
            raise AssertionError(f"{what}: read bytes differ from the payload")


# -- helpers -------------------------------------------------------------------


def _size_label(nbytes: int) -> str:
    return f"{nbytes // MIB}M" if nbytes % MIB == 0 else f"{nbytes >> 10}K"


def fs_type(path: Path) -> str:
    """File system type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            mount = fields[1]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fields[2]
    return kind


def pick_dir(requested: str | None) -> Path:
    """A fresh scratch dir on a real disk (never tmpfs unless asked for)."""
    if requested is not None:
        base = Path(requested)
        base.mkdir(parents=True, exist_ok=True)
        if fs_type(base) in ("tmpfs", "ramfs"):
            print(f"warning: {base} is {fs_type(base)}: measures memory, not disk")
        return Path(tempfile.mkdtemp(prefix="bench_store-", dir=base))
    for base in (Path("/var/tmp"), ROOT, Path(tempfile.gettempdir())):
        if base.is_dir() and fs_type(base) not in ("tmpfs", "ramfs"):
            return Path(tempfile.mkdtemp(prefix="bench_store-", dir=base))
    raise SystemExit("no disk-backed scratch dir found: pass --dir")


def probe_drop_method() -> str:
    """``drop_caches`` if this process may write it, else ``fadvise``."""
    try:
        os.sync()
        with open(DROP_CACHES, "w", encoding="ascii") as handle:
            handle.write("3\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def drop_cache(path: Path, method: str) -> None:
    """Evict ``path`` (a file or a dir tree) from the page cache."""
    os.sync()
    if method == "drop_caches":
        with open(DROP_CACHES, "w", encoding="ascii") as handle:
            handle.write("3\n")
        return
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def random_keys(count: int) -> list[bytes]:
    blob = os.urandom(16 * count)
    return [blob[i : i + 16] for i in range(0, len(blob), 16)]


# -- the block layout ----------------------------------------------------------


def spec_for(block_bytes: int) -> NamespaceSpec:
    """32 layers x (k, v) of F16 ``[16, heads, 128]``: exactly ``block_bytes``."""
    shape = (TOKENS, BLOCK_HEADS[block_bytes], HEAD_DIM)
    layers = tuple(
        LayerSpec(
            f"layers.{i}", (PartSpec("k", "F16", shape), PartSpec("v", "F16", shape))
        )
        for i in range(LAYERS)
    )
    spec = NamespaceSpec(
        model=f"bench-{_size_label(block_bytes)}",
        block_size=TOKENS,
        kv_dtype="F16",
        layers=layers,
    )
    assert spec.block_bytes == block_bytes, (spec.block_bytes, block_bytes)
    return spec


def tensor_views(buf: np.ndarray, spec: NamespaceSpec) -> dict[str, np.ndarray]:
    """Tensor name -> ``[rows, *row_shape]`` view of ``buf`` in chunk file order."""
    rows = buf.size // spec.block_bytes
    views, offset = {}, 0
    for layer in spec.layers:
        for part in layer.parts:
            size = rows * part.row_bytes
            raw = buf[offset : offset + size]
            views[f"{layer.name}.{part.name}"] = raw.view(np.float16).reshape(
                rows, *part.row_shape
            )
            offset += size
    return views


# -- raw -----------------------------------------------------------------------


def raw_write(
    ctx: Context, path: Path, fsync_every: int | None, writeback: bool = False
) -> float:
    """Sequential write of the payload to one file; fsync at the end (or every
    ``fsync_every`` bytes). ``writeback`` starts each piece's writeback at once
    (sync_file_range), which the kernel otherwise delays until the fsync."""
    data = ctx.payload.data
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset in range(0, ctx.total, RAW_PIECE):
            piece = data[offset : offset + RAW_PIECE]
            while piece:
                piece = piece[os.write(fd, piece) :]
            if writeback:
                sync_file_range_write(fd, offset, RAW_PIECE)
            if fsync_every and (offset + RAW_PIECE) % fsync_every == 0:
                os.fsync(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def raw_read(ctx: Context, path: Path, direct: bool = False) -> float:
    """Sequential ``preadv`` of 8 MiB pieces into the 64 MiB scratch buffer
    (page-aligned, so ``direct`` reads need no bounce buffer)."""
    out = ctx.out.data
    elapsed = 0.0
    fd = open_direct(path, os.O_RDONLY)[0] if direct else os.open(path, os.O_RDONLY)
    try:
        for start, batch in ctx.batches():
            begin = time.perf_counter()
            for offset in range(0, batch.size, RAW_PIECE):
                piece = out[offset : offset + RAW_PIECE]
                if os.preadv(fd, [piece], start + offset) != len(piece):
                    raise OSError(f"{path}: short read at {start + offset}")
            elapsed += time.perf_counter() - begin
            ctx.verify(batch, "raw")
    finally:
        os.close(fd)
    return elapsed


# -- ours ----------------------------------------------------------------------


#: The disk's calibration (``run`` measures it first), saved into every
#: store's fresh directory: ``npukv calibrate``'s first-read route.
CALIBRATED: Calibration | None = None


def open_store(
    path: Path,
    spec: NamespaceSpec,
    total: int,
    verify: str = "always",
    direct_io: bool = True,
    tuning: ReadTuning | None = None,
) -> KVStore:
    config = StoreConfig(
        cache_dir=str(path),
        capacity=2 * total + BATCH_BYTES,
        verify=verify,
        direct_io=direct_io,
    )
    store = KVStore(config, spec, read_tuning=tuning)
    if CALIBRATED is not None:  # its reads take the route the disk's chose
        calibration.save(store.dir, CALIBRATED)
    return store


def ours_write(ctx: Context, store: KVStore, keys: list[bytes]) -> float:
    """One ``put`` per 64 MiB batch (one chunk each)."""
    rows = BATCH_BYTES // store.spec.block_bytes
    elapsed = 0.0
    for start, batch in ctx.batches():
        first = start // store.spec.block_bytes
        tensors = tensor_views(batch, store.spec)
        begin = time.perf_counter()
        result = store.put(keys[first : first + rows], tensors)
        elapsed += time.perf_counter() - begin
        if result.stored != rows:
            raise AssertionError(f"put stored {result}, expected {rows} rows")
    return elapsed


def ours_read(ctx: Context, store: KVStore, keys: list[bytes]) -> float:
    """One ``read`` per 64 MiB batch into the preallocated ``out`` views."""
    rows = BATCH_BYTES // store.spec.block_bytes
    out = tensor_views(ctx.out, store.spec)
    elapsed = 0.0
    for start, batch in ctx.batches():
        first = start // store.spec.block_bytes
        begin = time.perf_counter()
        ok = store.read(keys[first : first + rows], out)
        elapsed += time.perf_counter() - begin
        if not all(ok):
            raise AssertionError(f"read: {ok.count(False)} misses, expected none")
        ctx.verify(batch, "ours")
    return elapsed


def ours_read_all(ctx: Context, store: KVStore, keys: list[bytes]) -> float:
    """One ``read`` of every key into the payload-sized ``out_all``."""
    out = tensor_views(ctx.out_all, store.spec)
    begin = time.perf_counter()
    ok = store.read(keys, out)
    elapsed = time.perf_counter() - begin
    if not all(ok):
        raise AssertionError(f"read: {ok.count(False)} misses, expected none")
    if ctx.check:  # ``out`` is layer-major over all keys, the payload per batch
        rows = BATCH_BYTES // store.spec.block_bytes
        for start, batch in ctx.batches():
            first = start // store.spec.block_bytes
            for name, array in tensor_views(batch, store.spec).items():
                got = out[name][first : first + rows]  # bytes: random F16 has NaNs
                if not np.array_equal(got.view(np.uint8), array.view(np.uint8)):
                    raise AssertionError(f"ours, one call: {name} differs")
    return elapsed


# -- safetensors, one file per block -------------------------------------------


def st_write(ctx: Context, path: Path, spec: NamespaceSpec) -> float:
    """``save_file`` per block + fsync per file + one dir fsync per 64 MiB."""
    path.mkdir()
    rows = BATCH_BYTES // spec.block_bytes
    start_time = time.perf_counter()
    for start, batch in ctx.batches():
        views = tensor_views(batch, spec)
        for row in range(rows):
            file = path / f"{start // spec.block_bytes + row:08d}.safetensors"
            save_file({name: view[row] for name, view in views.items()}, str(file))
            fsync_path(file)
        fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)
    return time.perf_counter() - start_time


def st_read(ctx: Context, path: Path, spec: NamespaceSpec) -> float:
    """``load_file`` per block, copied into the preallocated buffer."""
    rows = BATCH_BYTES // spec.block_bytes
    out = tensor_views(ctx.out, spec)
    elapsed = 0.0
    for start, batch in ctx.batches():
        begin = time.perf_counter()
        for row in range(rows):
            file = path / f"{start // spec.block_bytes + row:08d}.safetensors"
            for name, array in load_file(str(file)).items():
                out[name][row] = array
        elapsed += time.perf_counter() - begin
        ctx.verify(batch, "safetensors")
    return elapsed


# -- LMDB as a blob store ------------------------------------------------------


def lmdb_open(path: Path, total: int) -> lmdb.Environment:
    return lmdb.open(
        str(path),
        map_size=2 * total + BATCH_BYTES,
        sync=True,
        metasync=True,
        writemap=False,
        readahead=True,
        max_dbs=0,
    )


def lmdb_write(ctx: Context, path: Path, keys: list[bytes], block: int) -> float:
    """One write txn (commit + sync) per 64 MiB; value = one whole block."""
    env = lmdb_open(path, ctx.total)
    try:
        start_time = time.perf_counter()
        for start, batch in ctx.batches():
            with env.begin(write=True) as txn:
                for offset in range(0, batch.size, block):
                    key = keys[(start + offset) // block]
                    txn.put(key, batch[offset : offset + block].data)
        return time.perf_counter() - start_time
    finally:
        env.close()


def lmdb_read(
    ctx: Context, env: lmdb.Environment, keys: list[bytes], block: int
) -> float:
    """``txn.get`` (a view into the map) copied into the preallocated buffer."""
    elapsed = 0.0
    for start, batch in ctx.batches():
        begin = time.perf_counter()
        with env.begin(buffers=True) as txn:
            for offset in range(0, batch.size, block):
                value = txn.get(keys[(start + offset) // block])
                if value is None:
                    raise AssertionError("lmdb: a stored key is missing")
                ctx.out[offset : offset + block] = np.frombuffer(value, np.uint8)
        elapsed += time.perf_counter() - begin
        ctx.verify(batch, "lmdb")
    return elapsed


# -- one round -----------------------------------------------------------------


Best = dict[Case, float]  # case -> best seconds over rounds


def record(best: Best, case: Case, seconds: float) -> None:
    best[case] = min(seconds, best.get(case, float("inf")))


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def record_read(
    best: Best, ctx: Context, case: Case, read: Callable[[], float]
) -> None:
    """``record`` one read, and the CPU time it took: a store that verifies
    every byte spends more CPU per byte than one that copies, and on a VM the
    host may not give its second core (``cpu_steal_share``)."""
    cpu = cpu_seconds()
    record(best, case, read())
    ctx.cpu[case] = min(cpu_seconds() - cpu, ctx.cpu.get(case, float("inf")))


def read_twice(
    best: Best,
    ctx: Context,
    name: str,
    block: int,
    path: Path,
    read: Callable[[], float],
    admit: bool = False,
) -> None:
    """Cold read (cache dropped for ``path``) then warm read. ``admit``: one
    untimed read in between, for the store, whose first read of a chunk goes
    around the page cache (O_DIRECT) and whose second read admits it."""
    drop_cache(path, ctx.drop_method)
    record_read(best, ctx, Case(name, block, COLD), read)
    if admit:
        read()
    record_read(best, ctx, Case(name, block, WARM), read)


def run_raw(best: Best, ctx: Context) -> None:
    path = ctx.root / "raw.bin"
    record(best, Case("raw", 0, WRITE), raw_write(ctx, path, None))
    read_twice(best, ctx, "raw", 0, path, lambda: raw_read(ctx, path))
    drop_cache(path, ctx.drop_method)
    record(best, Case("raw_direct", 0, COLD), raw_read(ctx, path, direct=True))
    record(best, Case("raw_fsync64m", 0, WRITE), raw_write(ctx, path, BATCH_BYTES))
    record(best, Case("raw_wb", 0, WRITE), raw_write(ctx, path, None, writeback=True))
    path.unlink()


def run_ours(best: Best, ctx: Context, block: int) -> None:
    path = ctx.root / f"ours-{_size_label(block)}"
    keys = random_keys(ctx.total // block)
    store = open_store(path, spec_for(block), ctx.total)
    try:
        record(best, Case("ours", block, WRITE), ours_write(ctx, store, keys))
        read_twice(
            best, ctx, "ours", block, path, lambda: ours_read(ctx, store, keys), True
        )
    finally:
        store.close()
    if block == 2 * MIB:
        # On fresh handles (their first read of a chunk is O_DIRECT again):
        # one call over every chunk, and what the checksums cost (unverified).
        # Buffered (direct_io off), one call: as the store decides (its 1 MiB
        # segments go through the engine), and with every layer streamed, so
        # each disk shows which of the two it prefers.
        extra = (
            ("ours_onecall", "always", ours_read_all, True, False),
            ("ours_noverify", "never", ours_read, True, False),
            ("ours_buffered", "always", ours_read_all, False, False),
            ("ours_buffered_stream", "always", ours_read_all, False, True),
        )
        for name, verify, read, direct_io, stream_all in extra:
            # stream_all: every buffered layer the cache does not hold is
            # streamed, not only those in segments over one engine request
            tuning = ReadTuning(stream_above_bytes=0) if stream_all else None
            handle = open_store(
                path, spec_for(block), ctx.total, verify=verify,
                direct_io=direct_io, tuning=tuning,
            )  # fmt: skip
            try:
                read_twice(
                    best, ctx, name, block, path,
                    lambda: read(ctx, handle, keys), True,  # noqa: B023 - now
                )  # fmt: skip
            finally:
                handle.close()
    shutil.rmtree(path)


def run_safetensors(best: Best, ctx: Context, block: int) -> None:
    path = ctx.root / "st"
    spec = spec_for(block)
    record(best, Case("st", block, WRITE), st_write(ctx, path, spec))
    read_twice(best, ctx, "st", block, path, lambda: st_read(ctx, path, spec))
    shutil.rmtree(path)


def run_lmdb(best: Best, ctx: Context, block: int) -> None:
    path = ctx.root / "lmdb"
    keys = random_keys(ctx.total // block)
    record(best, Case("lmdb", block, WRITE), lmdb_write(ctx, path, keys, block))
    drop_cache(path, ctx.drop_method)
    env = lmdb_open(path, ctx.total)  # opened after the drop: a cold start
    try:
        for op in (COLD, WARM):
            record_read(
                best, ctx, Case("lmdb", block, op),
                lambda: lmdb_read(ctx, env, keys, block),
            )  # fmt: skip
    finally:
        env.close()
    shutil.rmtree(path)


def run_round(best: Best, ctx: Context, reverse: bool) -> None:
    """Every case once; raw runs between the others, order reversed on request."""
    runners: list[Callable[[], None]] = [
        lambda: run_raw(best, ctx),
        lambda: run_ours(best, ctx, 2 * MIB),
        lambda: run_safetensors(best, ctx, 2 * MIB),
        lambda: run_raw(best, ctx),
        lambda: run_ours(best, ctx, 512 << 10),
        lambda: run_lmdb(best, ctx, 2 * MIB),
    ]
    for runner in reversed(runners) if reverse else runners:
        runner()
        os.sync()


# -- lookup latency ------------------------------------------------------------


def bench_lookup(root: Path, iterations: int) -> tuple[float, float]:
    """p50/p99 (us) of ``lookup`` of a fully stored 256-key chain."""
    spec = NamespaceSpec(
        model="bench-lookup",
        block_size=TOKENS,
        kv_dtype="U8",
        layers=(LayerSpec("l0", (PartSpec("kv", "U8", (64,)),)),),
    )
    path = root / "lookup"
    store = open_store(path, spec, 64 * MIB)
    try:
        keys = store.keys_for(np.arange(LOOKUP_STORED * TOKENS))
        for first in range(0, len(keys), 32):
            batch = keys[first : first + 32]
            store.put(batch, {"l0.kv": np.zeros((len(batch), 64), np.uint8)})
        chain = keys[:LOOKUP_CHAIN]
        samples: list[float] = []
        for _ in range(LOOKUP_WARMUP):
            store.lookup(chain)
        for _ in range(iterations):
            begin = time.perf_counter_ns()
            found = store.lookup(chain)
            samples.append((time.perf_counter_ns() - begin) / 1e3)
            if found != LOOKUP_CHAIN:
                raise AssertionError(f"lookup found {found}, expected {LOOKUP_CHAIN}")
    finally:
        store.close()
    shutil.rmtree(path)
    return pct(samples, 0.5), pct(samples, 0.99)


# -- optional cProfile of ours at 2 MiB ----------------------------------------


def profile_ours(ctx: Context, top: int = 15) -> None:
    """cProfile one put pass and one cold read pass (2 MiB blocks)."""
    path = ctx.root / "profile"
    keys = random_keys(ctx.total // (2 * MIB))
    store = open_store(path, spec_for(2 * MIB), ctx.total)
    try:
        for what, run in (
            ("put", lambda: ours_write(ctx, store, keys)),
            ("read cold", lambda: ours_read(ctx, store, keys)),
        ):
            if what == "read cold":
                drop_cache(path, ctx.drop_method)
            profiler = cProfile.Profile()
            profiler.runcall(run)
            print(f"\n-- cProfile: ours 2M {what} (top {top} by tottime) --")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
    finally:
        store.close()
    shutil.rmtree(path)


# -- report --------------------------------------------------------------------


#: raw variants that can stand for "the disk's limit" in a direction
RAW_LIMITS = ("raw", "raw_wb", "raw_direct")


def raw_limit(best: Best, total: int, op: str) -> float:
    """The fastest raw variant measured for ``op``, in GB/s."""
    return max(
        gbps(total, best[Case(name, 0, op)])
        for name in RAW_LIMITS
        if Case(name, 0, op) in best
    )


LABELS = {
    "raw": "raw file",
    "raw_fsync64m": "raw file, fsync/64MiB",
    "raw_wb": "raw file, early writeback",
    "raw_direct": "raw file, O_DIRECT",
    "ours": "ours KVStore",
    "ours_onecall": "ours KVStore, 1 call",
    "ours_noverify": "ours KVStore, verify=never",
    "ours_buffered": "ours 1 call, direct_io off",
    "ours_buffered_stream": "ours 1 call, direct_io off, streamed",
    "st": "safetensors/block +fsync",
    "lmdb": "LMDB blob sync=True",
}


def row_order(case: Case) -> tuple[int, int, int]:
    return OPS.index(case.op), list(LABELS).index(case.name), -case.block


def results_table(
    best: Best, total: int, lookup: tuple[float, float], cpu: dict[Case, float]
) -> str:
    rows = []
    for case, seconds in best.items():
        rate = gbps(total, seconds)
        ratio = rate / raw_limit(best, total, case.op)
        name = f"{LABELS[case.name]} {case.op}"
        block = _size_label(case.block) if case.block else "-"
        spent = f"{cpu[case] / (total / 1e9):.3f}" if case in cpu else "-"
        rows.append([name, block, total, f"{rate:.3f}", f"{ratio:.2f}", spent])
    p50, p99 = lookup
    rows.append(
        [f"ours lookup {LOOKUP_CHAIN} keys", "-", "-",
         f"p50 {p50:.1f}/p99 {p99:.1f} us", "-", "-"]
    )  # fmt: skip
    return table(["case", "block", "bytes", "GB/s", "ratio", "CPU s/GB"], rows)


def results_json(
    best: Best,
    total: int,
    lookup: tuple[float, float],
    meta: dict[str, object],
    cpu: dict[Case, float],
) -> dict[str, object]:
    out: dict[str, object] = dict(meta)
    for case, seconds in best.items():
        rate = gbps(total, seconds)
        out[f"{case.key}_gbps"] = round(rate, 4)
        if case.name not in RAW_LIMITS:
            ratio = rate / raw_limit(best, total, case.op)
            out[f"{case.key}_ratio"] = round(ratio, 4)
        if case in cpu:
            out[f"{case.key}_cpu_s_per_gb"] = round(cpu[case] / (total / 1e9), 4)

    def speed(name: str, op: str, block: int = 2 * MIB) -> float:
        return gbps(total, best[Case(name, block, op)])

    write_ratio = speed("ours", WRITE) / raw_limit(best, total, WRITE)
    cold_ratio = speed("ours_onecall", COLD) / raw_limit(best, total, COLD)
    out["write_ratio"] = round(write_ratio, 4)
    out["read_cold_ratio"] = round(cold_ratio, 4)
    out["read_warm_ratio"] = round(
        speed("ours_onecall", WARM) / raw_limit(best, total, WARM), 4
    )
    out["read_cold_ratio_per_batch"] = round(
        speed("ours", COLD) / raw_limit(best, total, COLD), 4
    )
    out["read_warm_ratio_per_batch"] = round(
        speed("ours", WARM) / raw_limit(best, total, WARM), 4
    )
    out["read_cold_ratio_buffered"] = round(
        speed("ours_buffered", COLD) / raw_limit(best, total, COLD), 4
    )
    out["buffered_cold_stream_over_default"] = round(
        speed("ours_buffered_stream", COLD) / speed("ours_buffered", COLD), 4
    )
    out["lookup256_us_p50"] = round(lookup[0], 2)
    out["lookup256_us_p99"] = round(lookup[1], 2)
    out["targets_met"] = {
        "write_ratio>=0.8": write_ratio >= 0.8,
        "read_cold_ratio>=0.8": cold_ratio >= 0.8,
        "lookup256_us_p50<=100": lookup[0] <= 100,
        "ours>safetensors_write": speed("ours", WRITE) > speed("st", WRITE),
        "ours>safetensors_read_cold": speed("ours_onecall", COLD) > speed("st", COLD),
        "ours>lmdb_write": speed("ours", WRITE) > speed("lmdb", WRITE),
        "ours>lmdb_read_cold": speed("ours_onecall", COLD) > speed("lmdb", COLD),
        "ours>safetensors_read_warm": speed("ours_onecall", WARM) > speed("st", WARM),
        "ours>lmdb_read_warm": speed("ours_onecall", WARM) > speed("lmdb", WARM),
    }
    # the same comparisons for one read call per 64 MiB batch
    out["per_batch_read_cold_faster"] = {
        "ours>safetensors": speed("ours", COLD) > speed("st", COLD),
        "ours>lmdb": speed("ours", COLD) > speed("lmdb", COLD),
    }
    return out


# -- main ----------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", metavar="PATH", help="scratch dir parent (a disk)")
    parser.add_argument("--total-mib", type=int, help="bytes per case (MiB)")
    parser.add_argument("--rounds", type=int, help="rounds per case (>= 2)")
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile ours 2M put/read"
    )


def run(args: argparse.Namespace) -> Report:
    """The whole run (``--quick``: 256 MiB per case, 2 rounds, <= 60 s)."""
    report = Report(args)  # now: the commit of the code this process imported
    total = args.total_mib or (256 if args.quick else 1024)
    total = max(BATCH_BYTES, total * MIB // BATCH_BYTES * BATCH_BYTES)
    rounds = max(2, args.rounds or (2 if args.quick else 3))
    lookup_calls = 500 if args.quick else 2000
    root = pick_dir(args.dir)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    steal_start = cpu_ticks()
    try:
        drop_method = probe_drop_method()
        rng = np.random.default_rng(SEED)
        payload = np.frombuffer(rng.bytes(total), dtype=np.uint8)
        # Page-aligned, as a caller doing bulk reads allocates (O_DIRECT reads go
        # straight into it), and touched: no page faults inside the timings.
        scratch = aligned_buffer(BATCH_BYTES)
        scratch[:] = 1
        whole = aligned_buffer(total)
        whole[:] = 1
        ctx = Context(payload, scratch, whole, root, drop_method, check=True)
        print(
            f"dir {root} ({fs_type(root)}), {total // MIB} MiB per case, "
            f"best of {rounds} rounds, cache drop: {drop_method}"
        )
        global CALIBRATED
        CALIBRATED = measure_calibration(root)
        print(f"first reads: {calibration_text(CALIBRATED.summary())}")
        best: Best = {}
        lookups = [bench_lookup(root, lookup_calls)]  # before and after the I/O
        for round_no in range(rounds):
            ctx.check = round_no == 0  # byte-compare reads once, untimed
            run_round(best, ctx, reverse=bool(round_no % 2))
        lookups.append(bench_lookup(root, lookup_calls))
        lookup = min(lookups)  # the round with the best p50
        if args.profile:
            profile_ours(ctx)
        meta: dict[str, object] = {
            "python": platform.python_version(),
            "cache_drop_method": drop_method,
            "dir_fs": fs_type(root),
            "total_bytes": total,
            "rounds": rounds,
            "batch_bytes": BATCH_BYTES,
            "loadavg_1m": {"start": load_start, "end": os.getloadavg()[0]},
            "cpu_steal_share": steal_share(steal_start, cpu_ticks()),
            "lookup256_us_rounds": [[round(v, 2) for v in pair] for pair in lookups],
            # the route the calibration chose for every "ours" read case
            # without a forced tuning (docs/decisions/0063)
            "read_calibration": CALIBRATED.summary(),
            "first_reads": CALIBRATED.summary()["first_reads"],
        }
        best = dict(sorted(best.items(), key=lambda item: row_order(item[0])))
        print(results_table(best, total, lookup, ctx.cpu))
        print(f"cpu steal share (VM): {meta['cpu_steal_share']}")
        report.data = results_json(best, total, lookup, meta, ctx.cpu)
        report.data["wall_s"] = round(time.perf_counter() - started, 1)
        result = report.data
        print(
            f"ratios: write {result['write_ratio']}, read cold "
            f"{result['read_cold_ratio']}, read warm {result['read_warm_ratio']}"
        )
        print(f"targets_met: {result['targets_met']}")
        print(f"wall {result['wall_s']} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report
