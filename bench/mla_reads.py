"""Bytes the disk serves when several workers load the same MLA hit cold.

Why: MLA's latent KV is the same on every TP rank, so it is stored once (one
namespace, ``NamespaceSpec.rank_independent``) and every TP worker loads every
hit. If each worker's first read of a chunk went around the page cache
(O_DIRECT), the disk would serve the hit once per worker: 16x at TP 16
(docs/decisions/0063).

``measure(dir)`` writes ``gib`` GiB of MLA-shaped chunks (16 layers of rows of
64 tokens x 576 x 2 bytes, 256 blocks a chunk) into a cache directory under
``dir``, drops them from the page cache (``POSIX_FADV_DONTNEED``: only these
files, never the whole machine's cache), and then runs two loads, each cold:

  alone     one worker reads every key into page-aligned buffers (the
            loader's are): the cold-read speed one worker has by itself, the
            best of ``rounds``, each round once as a shared namespace's worker
            (buffered) and once as an unshared one's (O_DIRECT), interleaved
  together  ``workers`` spawned processes, one per TP rank, read every key at
            once, released by one barrier

Each worker reports its ``read_bytes`` from ``/proc/self/io`` (bytes this
process made the block layer read, its threads and io_uring workers
included) before and after its read; the sum over the workers is what the
disk served. The dict returned (and printed as JSON by ``python -m
bench.mla_reads``) has ``mla_disk_bytes_over_hit_bytes_<n>_workers``, the
per-worker seconds, and the alone read's seconds and GB/s. Pass
``shared=False`` to measure the namespace as if no other worker loaded it
(first reads O_DIRECT): the "before" figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from npukv_store import KVStore, LayerSpec, NamespaceSpec, PartSpec, StoreConfig
from npukv_store.io.direct import aligned_buffer

LAYERS = 16
TOKENS_PER_BLOCK = 64
ROW_BYTES = TOKENS_PER_BLOCK * 576 * 2  # DeepSeek's latent (512) + rope (64), bf16
BLOCKS_PER_CHUNK = 256


def io_read_bytes(pid: int | str = "self") -> int | None:
    """``read_bytes`` of ``/proc/<pid>/io``; None where the kernel does not
    count it (no task I/O accounting, or no procfs)."""
    try:
        with open(f"/proc/{pid}/io", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def mla_spec(
    workers: int, rank: int = 0, shared: bool = True, layers: int = LAYERS
) -> NamespaceSpec:
    """The namespace of an MLA model's latent cache at TP ``workers``, as the
    connector makes it (``connector/namespace.py``). ``shared=False`` keeps
    the same fingerprint but tells the store that no other worker loads it."""
    return NamespaceSpec(
        model="bench-mla",
        block_size=TOKENS_PER_BLOCK,
        kv_dtype="bfloat16",
        layers=tuple(
            LayerSpec(f"layers.{i}", (PartSpec("page", "U8", (ROW_BYTES,)),))
            for i in range(layers)
        ),
        tp_rank=rank if shared else 0,
        tp_size=workers if shared else 1,
        rank_independent=True,
    )


def fill(
    cache_dir: str,
    nbytes: int,
    workers: int,
    layers: int = LAYERS,
    blocks_per_chunk: int = BLOCKS_PER_CHUNK,
) -> list[bytes]:
    """Write about ``nbytes`` of chunks; returns their keys in order."""
    spec = mla_spec(workers, layers=layers)
    per_chunk = blocks_per_chunk * ROW_BYTES * layers
    chunks = max(1, round(nbytes / per_chunk))
    rng = np.random.default_rng(27)
    keys: list[bytes] = []
    config = StoreConfig(cache_dir=cache_dir, capacity=f"{nbytes * 2 + (1 << 30)}B")
    with KVStore(config, spec) as store:
        for _ in range(chunks):
            batch = [rng.bytes(16) for _ in range(blocks_per_chunk)]
            rows = rng.integers(0, 256, (blocks_per_chunk, ROW_BYTES), np.uint8)
            tensors = {name: rows for name in spec.tensor_names()}
            stored = store.put(batch, tensors).stored
            assert stored == blocks_per_chunk, f"put stored {stored} rows"
            keys += batch
    return keys


def drop_from_page_cache(cache_dir: str) -> None:
    """Evict every file of ``cache_dir`` from the page cache (they are clean:
    the store writes them synced or O_DIRECT)."""
    for path in Path(cache_dir).rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _out(keys: int, layers: int) -> dict[str, np.ndarray]:
    return {
        f"layers.{i}.page": aligned_buffer(keys * ROW_BYTES).reshape(keys, ROW_BYTES)
        for i in range(layers)
    }


def load(
    cache_dir: str,
    keys: list[bytes],
    workers: int,
    rank: int,
    shared: bool,
    layers: int = LAYERS,
    start: Any = None,
) -> dict[str, Any]:
    """One worker's load of every key (after ``start.wait()`` when given):
    its seconds, its read_bytes, and whether every key was read and verified."""
    spec = mla_spec(workers, rank, shared, layers)
    out = _out(len(keys), layers)
    config = StoreConfig(cache_dir=cache_dir, capacity="1TiB")
    with KVStore(config, spec) as store:
        if start is not None:
            start.wait()
        before = io_read_bytes()
        began = time.perf_counter()
        ok = store.read(keys, out)
        seconds = time.perf_counter() - began
        after = io_read_bytes()
        counters = store.stats().counters
    return {
        "rank": rank,
        "seconds": seconds,
        "read_bytes": None if before is None or after is None else after - before,
        "all_read": all(ok),
        "direct_read_bytes": counters["direct_read_bytes"],
    }


def _worker(args: tuple[Any, ...], start: Any, results: Any) -> None:
    try:
        results.put(load(*args, start=start))
    except BaseException as exc:  # the parent reports it
        results.put({"rank": args[3], "error": repr(exc)})
        raise


def load_together(
    cache_dir: str, keys: list[bytes], workers: int, shared: bool, layers: int = LAYERS
) -> list[dict[str, Any]]:
    """``workers`` spawned processes, one per rank, load every key at once."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(workers)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=((cache_dir, keys, workers, rank, shared, layers), start, results),
        )
        for rank in range(workers)
    ]
    for proc in procs:
        proc.start()
    found = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    errors = [r for r in found if "error" in r]
    if errors:
        raise RuntimeError(f"workers failed: {errors}")
    return sorted(found, key=lambda r: r["rank"])


def measure(
    dir: str | os.PathLike[str],
    workers: int = 4,
    gib: float = 1.0,
    *,
    shared: bool = True,
    layers: int = LAYERS,
    rounds: int = 3,
) -> dict[str, Any]:
    """Fill a cache under ``dir``, then cold loads alone (``rounds`` of each
    kind) and one by ``workers`` processes together; see the module docstring."""
    root = tempfile.mkdtemp(prefix="mla_reads-", dir=dir)
    cache_dir = os.path.join(root, "cache")
    alone_by_kind: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    try:
        keys = fill(cache_dir, int(gib * (1 << 30)), workers, layers)
        hit_bytes = len(keys) * ROW_BYTES * layers
        for number in range(rounds):
            kinds = (True, False) if number % 2 == 0 else (False, True)
            for kind in kinds:
                drop_from_page_cache(cache_dir)
                alone_by_kind[kind].append(
                    load(cache_dir, keys, workers, 0, kind, layers)
                )
        drop_from_page_cache(cache_dir)
        together = load_together(cache_dir, keys, workers, shared, layers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    alone = min(alone_by_kind[shared], key=lambda r: r["seconds"])
    direct_alone = min(alone_by_kind[False], key=lambda r: r["seconds"])
    buffered_alone = min(alone_by_kind[True], key=lambda r: r["seconds"])
    counted = [r["read_bytes"] for r in together]
    disk = None if None in counted else sum(counted)
    seconds = [r["seconds"] for r in together]
    return {
        "workers": workers,
        "shared": shared,
        "hit_bytes": hit_bytes,
        "disk_bytes": disk,
        f"mla_disk_bytes_over_hit_bytes_{workers}_workers": (
            None if disk is None else round(disk / hit_bytes, 3)
        ),
        "worker_seconds": [round(s, 3) for s in seconds],
        "worker_read_bytes": counted,
        "worker_direct_read_bytes": [r["direct_read_bytes"] for r in together],
        "all_read": all(
            r["all_read"]
            for r in together + [r for v in alone_by_kind.values() for r in v]
        ),
        "alone_seconds": round(alone["seconds"], 3),
        "alone_gbps": round(hit_bytes / alone["seconds"] / 1e9, 3),
        "alone_read_bytes": alone["read_bytes"],
        "alone_rounds": rounds,
        "alone_direct_gbps": round(hit_bytes / direct_alone["seconds"] / 1e9, 3),
        "alone_buffered_gbps": round(hit_bytes / buffered_alone["seconds"] / 1e9, 3),
        "alone_buffered_over_direct": round(
            direct_alone["seconds"] / buffered_alone["seconds"], 3
        ),
        "slowest_together_over_alone": round(max(seconds) / alone["seconds"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--unshared", action="store_true", help="the O_DIRECT figure")
    args = parser.parse_args()
    result = measure(
        args.dir, args.workers, args.gib, shared=not args.unshared, rounds=args.rounds
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
