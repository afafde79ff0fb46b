"""The store's side of the trace benchmark (bench/trace.py): a trace's
requests replayed through ``KVStore`` as vLLM's connector serves them, every
read checked against the bytes its hash id implies.

    payload()     - a block's k and v rows: a pure function of its hash id
    chunk_bytes() - the fixed and per-block bytes of this spec's chunk files
    replay()      - the trace through one directory, in one or more processes

A request: ``lookup`` of its chain (the hit length of its prefix), ``read``
of the hit blocks with every row's bytes checked, then one ``put`` of the
missing blocks after the hit with the hit's last block as their parent
(prefix-closed; blocks past capacity are not saved). The store runs with
the admission policy asked for, sized on the blocks' bytes on disk (chunk
headers included: at 512-byte blocks they are most of a chunk), so that its
shadow and ghost see the capacity in blocks the simulations see.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.harness.trace_sim import block_key, block_tokens
from npukv_store import KVStore, LayerSpec, NamespaceSpec, PartSpec
from npukv_store.config import StoreConfig
from npukv_store.store.admission import AdmissionTuning

PART_BYTES = 256
BLOCK_BYTES = 2 * PART_BYTES
LAYER = "trace.kv"
NAMES = (f"{LAYER}.k", f"{LAYER}.v")
SPEC = NamespaceSpec(
    model="bench-trace",
    block_size=512,
    kv_dtype="float16",
    layers=(
        LayerSpec(
            LAYER,
            (PartSpec("k", "U8", (PART_BYTES,)), PartSpec("v", "U8", (PART_BYTES,))),
        ),
    ),
)
SAMPLE_EVERY = 64  # requests between samples of the store's resident blocks

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_WORDS = np.arange(BLOCK_BYTES // 8, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)


# -- blocks -------------------------------------------------------------------


def payload(ids: Sequence[int]) -> dict[str, np.ndarray]:
    """The k and v rows of blocks ``ids``: splitmix64 of (id, word), a pure
    function of the hash id, so every read can be checked."""
    x = np.asarray(ids, dtype=np.uint64)[:, None] * _GOLDEN + _WORDS[None, :]
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    x ^= x >> np.uint64(31)
    rows = x.view(np.uint8).reshape(len(ids), BLOCK_BYTES)
    return {
        NAMES[0]: np.ascontiguousarray(rows[:, :PART_BYTES]),
        NAMES[1]: np.ascontiguousarray(rows[:, PART_BYTES:]),
    }


def chunk_bytes(root: str) -> tuple[int, int]:
    """(fixed bytes per chunk file, bytes per block) of this spec's chunks."""
    config = StoreConfig(cache_dir=root, capacity=1 << 30, fsync="never")
    with KVStore(config, SPEC) as store:
        sizes = []
        for n, base in ((1, 1 << 40), (2, 1 << 41)):
            ids = [base + i for i in range(n)]
            store.put([block_key(i) for i in ids], payload(ids))
            sizes.append(store.stats().total_bytes)
    one, two = sizes[0], sizes[1] - sizes[0]  # a 1-block and a 2-block chunk
    return 2 * one - two, two - one


# -- the store's replay ----------------------------------------------------------


def _replay(
    root: str,
    capacity_bytes: int,
    capacity_blocks: int,
    grace_s: float,
    fsync: str,
    admission: str,
    trace: Sequence[tuple[tuple[int, ...], int]],
    worker: int,
    procs: int,
    replay_rate: float,
) -> dict[str, Any]:
    """Requests ``worker``, ``worker + procs``, ... of ``trace`` (chain, input
    tokens) through one KVStore handle; counts."""
    config = StoreConfig(
        cache_dir=root, capacity=capacity_bytes, fsync=fsync, evict_grace_s=grace_s,
        admission=admission,
    )  # fmt: skip
    tuning = AdmissionTuning(block_bytes=capacity_bytes / capacity_blocks)
    keys_of: dict[int, bytes] = {}
    c: dict[str, Any] = dict.fromkeys(
        (
            "requests", "requested_blocks", "hit_blocks", "requested_tokens",
            "hit_tokens", "written_blocks", "saves", "refused_saves",
            "refused_blocks", "skipped_blocks", "stranded_blocks",
            "stranded_requests", "read_misses", "verify_failures",
        ),
        0,
    )  # fmt: skip
    resident: list[int] = []
    start = time.perf_counter()
    with KVStore(config, SPEC, admission_tuning=tuning) as store:
        for i in range(worker, len(trace), procs):
            if replay_rate > 0:
                wait = start + i / replay_rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            chain, length = trace[i]
            keys = []
            for block in chain:
                key = keys_of.get(block)
                if key is None:
                    key = keys_of[block] = block_key(block)
                keys.append(key)
            hit = store.lookup(keys)
            if hit:
                out = {name: np.empty((hit, PART_BYTES), np.uint8) for name in NAMES}
                ok = store.read(keys[:hit], out)
                want = payload(chain[:hit])
                for name in NAMES:
                    wrong = ~np.all(out[name] == want[name], axis=1)
                    c["verify_failures"] += int(np.count_nonzero(wrong & np.array(ok)))
                good = ok.index(False) if False in ok else hit
                c["read_misses"] += hit - good
                hit = good
            tokens = block_tokens(length, len(chain))
            c["requests"] += 1
            c["requested_blocks"] += len(chain)
            c["hit_blocks"] += hit
            c["requested_tokens"] += sum(tokens)
            c["hit_tokens"] += sum(tokens[:hit])
            if hit < len(chain):
                held = sum(loc is not None for loc in store.index.locate(keys[hit:]))
                c["stranded_blocks"] += held
                c["stranded_requests"] += held > 0
            limit = min(len(chain), capacity_blocks)
            if hit < limit:
                result = store.put(
                    keys[hit:limit], payload(chain[hit:limit]),
                    parent=keys[hit - 1] if hit else None,
                )  # fmt: skip
                c["saves"] += 1
                c["written_blocks"] += result.stored
                c["skipped_blocks"] += result.skipped
                c["refused_blocks"] += result.rejected
                c["refused_saves"] += result.rejected > 0
            if i % SAMPLE_EVERY == worker and 2 * i >= len(trace):
                resident.append(store.stats().num_blocks)
        counters = store.stats().counters
    c["seconds"] = time.perf_counter() - start
    c["file_bytes_written"] = counters["put_bytes"]
    c["declined_blocks"] = counters["declined_blocks"]
    c["lost_hit_blocks"] = counters["lost_hit_blocks"]
    c["wasted_write_blocks"] = counters["wasted_write_blocks"]
    c["evicted_chunks"] = counters["evicted_chunks"]
    c["resident"] = resident
    return c


def _worker(queue: Any, *args: Any) -> None:
    queue.put(_replay(*args))


def replay(
    root: str,
    capacity_bytes: int,
    capacity_blocks: int,
    args: argparse.Namespace,
    trace: Sequence[tuple[tuple[int, ...], int]],
) -> dict[str, Any]:
    """The store's replay of ``trace``, in ``args.procs`` processes."""
    common = (
        root, capacity_bytes, capacity_blocks, args.grace_s, args.fsync,
        args.admission, trace,
    )  # fmt: skip
    if args.procs <= 1:
        return _replay(*common, 0, 1, args.replay_rate)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    begin = time.perf_counter()
    procs = [
        ctx.Process(
            target=_worker, args=(queue, *common, w, args.procs, args.replay_rate)
        )
        for w in range(args.procs)
    ]
    for proc in procs:
        proc.start()
    parts = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"a replaying process exited with {proc.exitcode}")
    total: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            total[name] = (
                total.get(name, 0) + value
                if name != "resident"
                else [*total.get(name, []), *value]
            )
    total["seconds"] = time.perf_counter() - begin
    return total
