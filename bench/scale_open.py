"""bench_scale's open case: ``KVStore(...)`` at growing chunk counts, alone
and as the last of 17 processes opening at once (one TP 16 engine's
workers and its scheduler on one directory).

The directory is a real one (marker, secret, namespace) whose index holds
bulk-built chunk records without data files (bench/scale_fill.py): what an
open reads of the index and lists of the directory is there, at the size
named, and no chunk file is. Every open runs in its own spawned process
(LMDB opens an environment once per process), timed from a barrier that
all the processes of a round pass together: import time is not counted.
Each also reports its CPU time: 17 opens on fewer than 17 cores cannot all
finish within a lone open's time, so the concurrent row carries the bound
(their CPU over the cores) beside the ratio.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench import scale_fill as fill
from npukv_store import (
    KVStore,
    LayerSpec,
    NamespaceSpec,
    PartSpec,
    StoreConfig,
    parse_size,
)

#: a wait for the directory lock long enough for 17 opens of the largest size
_LOCK_WAIT_S = 1800.0


def tiny_spec() -> NamespaceSpec:
    """One layer of one part, 64 bytes a block: the open reads no data."""
    part = PartSpec("kv", "U8", (64,))
    return NamespaceSpec(
        model="bench-scale", block_size=16, kv_dtype="uint8",
        layers=(LayerSpec("model.layers.0.attn", (part,)),),
    )  # fmt: skip


def store_config(cache_dir: str, **kw: Any) -> StoreConfig:
    return StoreConfig(
        cache_dir=cache_dir,
        ring_size=parse_size("8MiB"),
        lock_timeout_s=_LOCK_WAIT_S,
        **kw,
    )


def _open_one(config: StoreConfig, spec: NamespaceSpec, barrier: Any, out: Any) -> None:
    barrier.wait(timeout=_LOCK_WAIT_S)
    t0, cpu0 = time.perf_counter(), time.process_time()
    store = KVStore(config, spec)
    took, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    store.close()
    out.put((took, cpu))


def timed_opens(
    config: StoreConfig, spec: NamespaceSpec, n: int
) -> list[tuple[float, float]]:
    """``(wall, CPU)`` seconds each of ``n`` processes took to open, all
    starting together, by wall time."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_open_one, args=(config, spec, barrier, out))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    try:
        return sorted(out.get(timeout=_LOCK_WAIT_S + 120) for _ in range(n))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def run_case(
    root: str, sizes: Sequence[int], concurrent_at: int, processes: int, repeats: int
) -> dict[str, Any]:
    """Lone opens (median of ``repeats``) at each size; ``processes`` opens
    at once at ``concurrent_at`` chunks (one of ``sizes``)."""
    config, spec = store_config(os.path.join(root, "cache")), tiny_spec()
    with KVStore(config, spec) as store:
        namespace, index_path = store.fingerprint, store.dir.index_path
    rows, filled, fill_s = [], 0, 0.0
    concurrent: dict[str, Any] = {}
    for n in sizes:
        fill_s += fill.fill(index_path, filled, n, namespace=namespace)
        filled = n
        alone = [timed_opens(config, spec, 1)[0][0] for _ in range(repeats)]
        row: dict[str, Any] = {"chunks": n, "alone_s": statistics.median(alone)}
        if n == concurrent_at:
            opens = timed_opens(config, spec, processes)
            walls = [wall for wall, _ in opens]
            cpu = sum(c for _, c in opens)
            concurrent = {
                "chunks": n, "processes": processes, "alone_s": row["alone_s"],
                "last_s": walls[-1], "median_s": statistics.median(walls),
                "first_s": walls[0], "cpu_s": cpu, "cpus": _cpus(),
                # the earliest the last could finish with no lock at all:
                # every open's CPU spread over the cores, or one lone open
                "cpu_bound_s": max(row["alone_s"], cpu / _cpus()),
            }  # fmt: skip
        rows.append(row)
    return {
        "rows": rows,
        "concurrent": concurrent,
        "fill_s": round(fill_s, 2),
        "records": "bulk-built chunk records (7 keys each), no data files",
    }
