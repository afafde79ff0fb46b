"""bench_scale's maintenance case: rebuild-index, ``npukv gc``, ``npukv
verify`` and ``npukv compact`` over many real chunk files, in chunks per
second.

The chunks are real files, each of one or two blocks of one tiny layer (a
decode step's save: the many-small-chunks case), written by ``KVStore.put``
with ``fsync: never`` (only to write them fast). Then, on that directory:

    rebuild    ``recovery.rebuild_index`` unsynced, synced, synced, unsynced
               (ABBA: a drift of the machine's speed favours neither; the
               faster of each pair is kept: the sync is what differs)
    verify     ``npukv verify DIR``: every invariant, every block's checksum
    gc         ``npukv gc DIR``
    compact    ``npukv compact DIR``: the small chunks merged, last (it
               rewrites the directory)

The commands run as the operator runs them, each in its own process; the
rebuild through its public function, the only way to choose its sync.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench import scale_fill as fill
from bench.harness.processes import in_process
from bench.scale_open import store_config
from npukv_store import KVStore, LayerSpec, NamespaceSpec, PartSpec
from npukv_store.maintenance import open_cache
from npukv_store.store import recovery


def _spec() -> NamespaceSpec:
    part = PartSpec("kv", "F16", (16, 1, 8))  # 256 bytes a block
    return NamespaceSpec(
        model="bench-scale-maint", block_size=16, kv_dtype="float16",
        layers=(LayerSpec("model.layers.0.attn", (part,)),),
    )  # fmt: skip


def write_chunks(cache_dir: str, n_chunks: int) -> float:
    """``n_chunks`` chunk files of 1-2 blocks each; returns seconds taken."""
    spec = _spec()
    t0 = time.perf_counter()
    with KVStore(store_config(cache_dir, fsync="never"), spec) as store:
        key = 0
        for c in range(n_chunks):
            rows = 1 + c % 2
            ks = fill.keys(key, key + rows, salt=1 << 50)
            key += rows
            data = np.full((rows, 16, 1, 8), c % 251, np.float16)
            res = store.put(ks, {"model.layers.0.attn.kv": data})
            if res.stored != rows:
                raise RuntimeError(f"chunk {c}: stored {res.stored} of {rows} rows")
    return time.perf_counter() - t0


def _rebuild_here(cache_dir: str, sync: bool) -> tuple[float, int]:
    cdir = open_cache(cache_dir)
    kwargs: dict[str, Any] = {"map_size": 8 << 30, "sync": sync}
    params = inspect.signature(recovery.rebuild_index).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in params}  # robust to renames
    # it takes the directory lock itself, as an opening process does
    t0 = time.perf_counter()
    index = recovery.rebuild_index(cdir, **kwargs)
    took = time.perf_counter() - t0
    try:
        chunks = index.totals()[1]
    finally:
        index.close()
    return took, chunks


def rebuild(cache_dir: str, sync: bool) -> tuple[float, int]:
    """Seconds of one rebuild, and the chunks it published."""
    took, chunks = in_process(_rebuild_here, cache_dir, sync)
    return float(took), int(chunks)


def command(*argv: str) -> tuple[float, int, str]:
    """Seconds, exit status and output of one ``npukv`` command, run as the
    operator runs it: its own process (the seconds include its start, about
    a second here, the same for every size)."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "npukv_store.cli", *argv],
        capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    return time.perf_counter() - t0, done.returncode, done.stdout + done.stderr


def run_case(root: str, n_chunks: int) -> dict[str, Any]:
    cache_dir = os.path.join(root, "maint")
    write_s = in_process(write_chunks, cache_dir, n_chunks)
    rebuilds: dict[str, list[float]] = {"nosync": [], "sync": []}
    for sync in (False, True, True, False):
        took, chunks = rebuild(cache_dir, sync)
        if chunks != n_chunks:
            raise RuntimeError(f"rebuild published {chunks} of {n_chunks} chunks")
        rebuilds["sync" if sync else "nosync"].append(took)
    nosync, synced = min(rebuilds["nosync"]), min(rebuilds["sync"])
    out: dict[str, Any] = {
        "chunks": n_chunks,
        "write_s": round(write_s, 2),
        "rebuild_nosync_s": nosync,
        "rebuild_sync_s": synced,
        "rebuild_nosync_chunks_s": n_chunks / nosync,
        "rebuild_sync_chunks_s": n_chunks / synced,
    }
    for name, argv in (
        ("verify", ("verify", cache_dir)),  # first: it only reads
        ("gc", ("gc", cache_dir)),
        ("compact", ("compact", cache_dir)),
    ):
        # a command that fails is reported, not fatal: the other figures stand
        took, code, text = command(*argv)
        if code != 0:
            out[f"{name}_error"] = f"exit {code}: {text[-300:]}"
            continue
        out[f"{name}_s"] = took
        out[f"{name}_chunks_s"] = n_chunks / took
    return out
