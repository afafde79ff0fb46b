"""Multi-process and SIGKILL scenarios of the store, as plain parameterised functions.

Used by: ``tests/integration/test_multiprocess.py`` and ``test_crash.py`` (quick
forms) and ``tests/stress/test_stress.py`` (long forms, also an argparse script).
No pytest here: a scenario raises ``AssertionError`` naming what broke, the seed
and the trial, and returns a summary dict the callers print or assert on.

Every block's bytes are a pure function of its key (:func:`block_content`), so any
process can verify what it reads without talking to the writer.

    tiny_spec()           - a small namespace: 3 layers, parts k and v, F16 rows
    make_tensors()        - the put() input for a list of keys
    verify_read()         - rows read() reported as hits whose bytes are wrong
    verify_store()        - read every indexed key back; check() with data
    run_multiprocess()    - N spawned workers put/lookup/read one small cache
    run_crash_trials()    - a writer SIGKILLed at random or chosen publish points
    random_plan(), targeted_plan() - crash trial plans

Crash trial classes (``CrashTrial``), and what each one covers:

* plain (``hooks=False, target=None``): the child puts 1-4 block chunks in a loop
  with ``fsync="chunk"``; SIGKILL lands after a uniform random delay, mostly in
  the tmp write and fsyncs, sometimes inside the LMDB commit or between puts.
* widened (``hooks=True, target=None``): as plain, but the child wraps
  ``os.fsync``, ``os.rename`` and ``Index.commit_chunk`` / ``_touch_in`` /
  ``_unpublish_in`` with random 0-3 ms naps, so random kills land more often
  between rename and commit, inside the write transaction, and between commit
  and the put's return.
* targeted (``hooks=True, target=PHASE_*``): the child publishes its publish
  phase in shared memory and stops when it enters the target phase; the parent
  kills it there, so every window is hit for certain: tmp written (before
  rename), renamed but not committed, inside the LMDB write transaction (holding
  the write lock), committed but not returned, and, with ``evict=True``,
  evicting inside the transaction and evicted but the victims' files not yet
  unlinked. The parent asserts the leftover each window must leave: a tmp file
  of the dead pid, an unindexed chunk file, or the in-flight put's keys readable.

After every kill the parent reopens the store and checks: ``check(verify_data=True)``
is empty; no tmp/ file is left (none of the dead pid, none at all); every chunk
file on disk is indexed (all creators are dead, so no orphan may survive); every
indexed key reads back with the right bytes; every put whose return was logged is
still readable (when nothing is evicted); the ledger stays within capacity.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import random
import signal
import stat
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from npukv_store import (
    KVStore,
    LayerSpec,
    NamespaceSpec,
    PartSpec,
    PutResult,
    StoreConfig,
)
from npukv_store.hashing import namespace_fingerprint
from npukv_store.store.directory import HOST, CacheDir
from npukv_store.store.format import encode_header
from npukv_store.store.index import Index

_NUMPY_DTYPES = {"F16": np.float16, "U8": np.uint8, "F32": np.float32}
_POISON = 0xA5  # fills read buffers: a row read() did not fill never matches

# -- the namespace and block contents ----------------------------------------


def tiny_spec(
    num_layers: int = 3, row_shape: tuple[int, ...] = (16, 2, 8), block_size: int = 4
) -> NamespaceSpec:
    """A small namespace: ``num_layers`` layers of parts k and v, F16 rows."""
    layers = tuple(
        LayerSpec(
            f"layer{i}",
            (PartSpec("k", "F16", row_shape), PartSpec("v", "F16", row_shape)),
        )
        for i in range(num_layers)
    )
    return NamespaceSpec(
        model="npukv-test/tiny",
        block_size=block_size,
        kv_dtype="float16",
        layers=layers,
    )


def _layout(spec: NamespaceSpec) -> dict[str, tuple[int, int, PartSpec]]:
    """tensor name -> (begin, end, part) of its bytes inside one block's content."""
    layout, offset = {}, 0
    for layer in spec.layers:
        for part in layer.parts:
            layout[f"{layer.name}.{part.name}"] = (
                offset,
                offset + part.row_bytes,
                part,
            )
            offset += part.row_bytes
    return layout


def block_content(spec: NamespaceSpec, key: bytes) -> np.ndarray:
    """The ``uint8 [block_bytes]`` every writer stores for ``key``."""
    rng = np.random.default_rng(int.from_bytes(key, "little"))
    return rng.integers(0, 256, spec.block_bytes, dtype=np.uint8)


def _layer_names(spec: NamespaceSpec, layers: Iterable[int] | None) -> list[str]:
    chosen = range(len(spec.layers)) if layers is None else layers
    return [name for li in chosen for name in spec.layers[li].tensor_names()]


def make_tensors(
    spec: NamespaceSpec, keys: Sequence[bytes], layers: Iterable[int] | None = None
) -> dict[str, np.ndarray]:
    """tensor name -> ``[len(keys), *row_shape]`` array of the keys' contents."""
    blocks = np.stack([block_content(spec, k) for k in keys])
    layout = _layout(spec)
    tensors = {}
    for name in _layer_names(spec, layers):
        begin, end, part = layout[name]
        rows = np.ascontiguousarray(blocks[:, begin:end])
        tensors[name] = rows.view(_NUMPY_DTYPES[part.dtype]).reshape(
            len(keys), *part.row_shape
        )
    return tensors


def empty_out(
    spec: NamespaceSpec, num_keys: int, layers: Iterable[int] | None = None
) -> dict[str, np.ndarray]:
    """read() buffers for ``num_keys`` blocks, pre-filled with a poison pattern."""
    layout = _layout(spec)
    out = {}
    for name in _layer_names(spec, layers):
        begin, end, part = layout[name]
        raw = np.full((num_keys, end - begin), _POISON, dtype=np.uint8)
        out[name] = raw.view(_NUMPY_DTYPES[part.dtype]).reshape(
            num_keys, *part.row_shape
        )
    return out


def verify_read(
    spec: NamespaceSpec,
    keys: Sequence[bytes],
    out: dict[str, np.ndarray],
    ok: Sequence[bool],
) -> list[str]:
    """One line per row read() called a hit whose bytes are not the key's."""
    hits = [i for i, hit in enumerate(ok) if hit]
    if not hits:
        return []
    layout = _layout(spec)
    problems = []
    for i in hits:
        want = block_content(spec, keys[i])
        for name, array in out.items():
            begin, end, _ = layout[name]
            got = array[i].reshape(-1).view(np.uint8)
            if not np.array_equal(got, want[begin:end]):
                problems.append(
                    f"read() returned True for key {keys[i].hex()} but tensor "
                    f"{name} holds wrong bytes"
                )
    return problems


def max_chunk_bytes(spec: NamespaceSpec, num_blocks: int) -> int:
    """An upper bound of the file size of a chunk of ``num_blocks`` blocks."""
    header = encode_header(
        spec,
        namespace_fingerprint(spec).hex(),
        [bytes(16)] * num_blocks,
        creator=f"{2**22}@{HOST}",  # longest pid: headers are padded anyway
        created_ns=2**63 - 1,
    )
    return len(header) + num_blocks * (spec.block_bytes + 8 * len(spec.layers))


def do_put(store: KVStore, keys: list[bytes], tensors, mode: str):
    """One put the way ``mode`` says: "sync" is ``put``; "async" is
    ``put_async`` + ``flush`` (the async path's durability point), with the
    outcome read from the counters the writer thread updated."""
    if mode == "sync":
        return store.put(keys, tensors)
    before = store.counters.snapshot()
    staged = store.put_async(keys, tensors)
    if not store.flush(timeout_s=60):
        raise RuntimeError("flush() did not finish in 60 s")
    after = store.counters.snapshot()
    if staged.dropped or after["failed_batches"] != before["failed_batches"]:
        raise RuntimeError(f"async put lost its batch: {staged}, {after}")
    return PutResult(
        stored=after["put_blocks"] - before["put_blocks"],
        skipped=after["skipped_blocks"] - before["skipped_blocks"],
        rejected=after["rejected_blocks"] - before["rejected_blocks"],
    )


def indexed_keys(store: KVStore) -> list[bytes]:
    """Every key the shared index holds (one snapshot)."""
    return [key for key, _, _ in store.index.iter_keys()]


def read_and_verify(
    store: KVStore, keys: Sequence[bytes], *, expect_all: bool
) -> list[str]:
    """Read ``keys`` (in batches); problems: wrong bytes, or misses if
    ``expect_all``."""
    problems = []
    for start in range(0, len(keys), 256):
        batch = list(keys[start : start + 256])
        out = empty_out(store.spec, len(batch))
        ok = store.read(batch, out)
        problems += verify_read(store.spec, batch, out, ok)
        if expect_all:
            problems += [
                f"key {k.hex()} should be readable but read() missed it"
                for k, hit in zip(batch, ok, strict=True)
                if not hit
            ]
    return problems


def verify_store(store: KVStore) -> list[str]:
    """check() with data, then every indexed key must read back correctly.

    Call on a quiescent directory: nobody else may evict meanwhile.
    """
    problems = [f"check: {p}" for p in store.check(verify_data=True)]
    problems += read_and_verify(store, indexed_keys(store), expect_all=True)
    return problems


def chunk_files(cache_dir: str) -> dict[int, str]:
    """chunk id -> path, over every namespace of ``cache_dir``."""
    cdir = CacheDir(cache_dir)
    return {
        cid: path
        for ns in cdir.namespaces()
        for cid, path in cdir.chunk_files(ns).items()
    }


def chunk_bytes_on_disk(cache_dir: str) -> int:
    """Bytes of every chunk file in ``cache_dir`` (files may vanish meanwhile)."""
    total = 0
    for path in chunk_files(cache_dir).values():
        try:
            total += os.stat(path).st_size
        except FileNotFoundError:
            continue  # evicted between listdir and stat
    return total


def tmp_files(cache_dir: str) -> list[str]:
    """Names in ``cache_dir/tmp`` (in-flight writes and their crash leftovers)."""
    try:
        return sorted(os.listdir(os.path.join(cache_dir, "tmp")))
    except FileNotFoundError:
        return []


def _fail(what: str, problems: Sequence[str], limit: int = 20) -> None:
    if problems:
        shown = "\n  ".join(problems[:limit])
        more = (
            f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        )
        raise AssertionError(f"{what}: {len(problems)} problem(s):\n  {shown}{more}")


# -- scenario 1: concurrent workers on one small cache ------------------------

#: Prompts are a shared prefix (so workers race on the same keys) cut at a
#: random block, plus a short suffix over a tiny vocabulary (so suffixes collide
#: between workers too).
NUM_PREFIXES = 12
PREFIX_BLOCKS = 6
SUFFIX_BLOCKS = 3
SUFFIX_VOCAB = 2
MP_MAX_BLOCKS = PREFIX_BLOCKS + SUFFIX_BLOCKS
#: What every run must have exercised (summed tallies and counters > 0). A run
#: that has not when its ``seconds`` are up goes on, forcing each of them (see
#: :func:`_forced_step`), for up to ``overtime_s``; the parent's own
#: requirement (``until``) is the last flag.
MP_REQUIRED = ("put_stored", "put_skipped", "read_hits", "counter.evicted_chunks")


class NotExercised(AssertionError):
    """A randomized run found no fault but did not exercise what it checks,
    even with its overtime: run it again (another seed), do not pass it."""


def _prefixes(spec: NamespaceSpec, seed: int) -> list[list[int]]:
    rng = random.Random(f"prefixes:{seed}")
    tokens = PREFIX_BLOCKS * spec.block_size
    return [
        [rng.randrange(1000, 50000) for _ in range(tokens)] for _ in range(NUM_PREFIXES)
    ]


def _prompt(
    spec: NamespaceSpec, prefixes: list[list[int]], rng: random.Random
) -> list[int]:
    prefix = rng.choice(prefixes)[: rng.randint(1, PREFIX_BLOCKS) * spec.block_size]
    suffix = [
        rng.randrange(SUFFIX_VOCAB)
        for _ in range(rng.randint(0, SUFFIX_BLOCKS) * spec.block_size)
    ]
    return prefix + suffix


def _mp_worker(
    wid: int,
    config_kwargs: dict[str, Any],
    seed: int,
    seconds: float,
    fault_after_s: float | None,
    barrier,
    results,
    mode: str = "sync",
    exercised=None,
    overtime_s: float = 0.0,
) -> None:
    """Entry point of one spawned worker: reports ("ok"|"error", wid, payload)."""
    try:
        report = _mp_worker_loop(
            wid, config_kwargs, seed, seconds, fault_after_s, barrier, mode,
            exercised, overtime_s,
        )  # fmt: skip
        results.put(("ok", wid, report))
    except BaseException:
        results.put(("error", wid, traceback.format_exc()))
        raise


def _mp_worker_loop(
    wid: int,
    config_kwargs: dict[str, Any],
    seed: int,
    seconds: float,
    fault_after_s: float | None,
    barrier,
    mode: str = "sync",
    exercised=None,
    overtime_s: float = 0.0,
) -> dict[str, Any]:
    """Random steps for ``seconds``; then, while some flag of ``exercised``
    (one per MP_REQUIRED name, set by any worker, then the parent's) is
    unset, for up to ``overtime_s`` more, random steps each followed by a
    forced one."""
    spec = tiny_spec()
    # Odd workers trust the disk (verify="never"): a wrong row they get is not
    # masked as a checksum miss, so the byte comparison below sees it.
    verify = "never" if wid % 2 else "always"
    store = KVStore(StoreConfig(**config_kwargs, verify=verify), spec)
    prefixes = _prefixes(spec, seed)
    rng = random.Random(f"worker:{seed}:{wid}")
    tally: Counter[str] = Counter()
    max_total = 0
    problems: list[str] = []
    barrier.wait(timeout=120)
    start = time.monotonic()
    fresh = 0
    while not problems:
        now = time.monotonic()
        overtime = now >= start + seconds
        if overtime and (
            exercised is None or all(exercised) or now >= start + seconds + overtime_s
        ):
            break
        if (
            fault_after_s is not None
            and wid == 0
            and time.monotonic() > start + fault_after_s
        ):
            raise RuntimeError("injected worker fault (harness self-test)")
        _random_step(store, spec, prefixes, rng, mode, tally, problems)
        if overtime and exercised is not None and not all(exercised[:-1]):
            _forced_step(store, spec, wid, fresh, rng, mode, tally, problems)
            fresh += 1
        if exercised is not None:
            _note_exercised(exercised, tally, store.counters.snapshot())
        max_total = max(max_total, store.stats().total_bytes)
    counters = store.stats().counters
    store.close()
    return {
        "tally": dict(tally),
        "counters": counters,
        "max_total": max_total,
        "problems": problems[:20],
        "verify": verify,
    }


def _note_exercised(exercised, tally: Counter[str], counters: dict[str, int]) -> None:
    """Set the flag of each MP_REQUIRED name this worker has exercised."""
    for index, name in enumerate(MP_REQUIRED):
        if name.startswith("counter."):
            value = counters.get(name.removeprefix("counter."), 0)
        else:
            value = tally[name]
        if value > 0:
            exercised[index] = 1


def _forced_step(
    store: KVStore,
    spec: NamespaceSpec,
    wid: int,
    fresh: int,
    rng: random.Random,
    mode: str,
    tally: Counter[str],
    problems: list[str],
) -> None:
    """A step that exercises what random steps may miss: put a prompt no one
    has put (MP_MAX_BLOCKS new blocks, a largest chunk: a few of these exceed
    any capacity, so commits must evict), read it back (hits), and put it
    again (skips: its blocks are stored)."""
    count = MP_MAX_BLOCKS * spec.block_size
    tokens = [rng.randrange(10**6, 10**9) for _ in range(count)]
    keys = store.keys_for([-1 - wid, fresh, *tokens])  # never a random step's prompt
    tally["lookups"] += 1
    store.lookup(keys)
    tensors = make_tensors(spec, keys)
    result = do_put(store, keys, tensors, mode)
    tally["put_stored"] += result.stored
    tally["put_skipped"] += result.skipped
    tally["put_rejected"] += result.rejected
    out = empty_out(spec, len(keys), None)
    ok = store.read(keys, out)
    problems += verify_read(spec, keys, out, ok)
    tally["read_hits"] += sum(ok)
    tally["read_misses"] += len(ok) - sum(ok)
    again = do_put(store, keys, tensors, mode)
    tally["put_stored"] += again.stored
    tally["put_skipped"] += again.skipped
    tally["put_rejected"] += again.rejected


def _random_step(
    store: KVStore,
    spec: NamespaceSpec,
    prefixes: list[list[int]],
    rng: random.Random,
    mode: str,
    tally: Counter[str],
    problems: list[str],
) -> None:
    """One random step: look a prompt up, read some of it, put what is missing."""
    keys = store.keys_for(_prompt(spec, prefixes, rng))
    hit = store.lookup(keys)
    tally["lookups"] += 1
    pick = rng.random()  # not `mode`: that is the put mode, used below
    if pick < 0.5:  # the connector's path: read what lookup promised
        read_keys, layers = keys[:hit], None
    elif pick < 0.75:  # also ask for blocks lookup did not report
        read_keys, layers = keys, None
    else:  # one layer only, as layerwise loading does
        read_keys, layers = keys, [rng.randrange(len(spec.layers))]
    if read_keys:
        out = empty_out(spec, len(read_keys), layers)
        ok = store.read(read_keys, out)
        problems += verify_read(spec, read_keys, out, ok)
        tally["read_hits"] += sum(ok)
        tally["read_misses"] += len(ok) - sum(ok)
        if pick < 0.5:  # allowed (evicted in between), but worth counting
            tally["lookup_hit_read_miss"] += len(ok) - sum(ok)
    if hit < len(keys):
        # Mostly the missing tail; sometimes the whole prompt, to take the
        # skip path and to race whole chunks against other workers.
        put_keys = keys if rng.random() < 0.25 else keys[hit:]
        absent = sum(loc is None for loc in store.index.locate(put_keys))
        result = do_put(store, put_keys, make_tensors(spec, put_keys), mode)
        tally["put_stored"] += result.stored
        tally["put_skipped"] += result.skipped
        tally["put_rejected"] += result.rejected
        # Rows absent just before put() that it neither stored nor rejected
        # were committed by another worker in between: a lost race (net of
        # rows another worker's eviction freed in between).
        tally["lost_races"] += absent - result.stored - result.rejected


def run_multiprocess(
    cache_dir: str,
    *,
    workers: int = 4,
    seconds: float = 5.0,
    capacity_chunks: float = 8.0,
    grace_s: float = 0.05,
    fsync: str = "never",
    seed: int = 0,
    fault_after_s: float | None = None,
    mode: str = "sync",
    during: Callable[[], None] | None = None,
    until: Callable[[], bool] | None = None,
    overtime_s: float = 30.0,
) -> dict[str, Any]:
    """``workers`` spawned processes put, look up and read one small cache
    (``mode`` "async": puts go through the ring and the background writer).
    ``during``, if given, is called again and again in the parent while the
    workers run (the live-compaction test runs the maintenance job there).

    Proves: no read returns wrong bytes (hit or miss only); the ledger never
    exceeds capacity by more than one chunk (sampled by every worker after every
    operation and by the parent every few ms); no worker raises; eviction,
    stores, skips and read hits really happened (MP_REQUIRED); the directory is
    consistent afterwards (check with data, every indexed key readable, tmp/
    empty).

    A run is randomized, so whether it exercises MP_REQUIRED (and ``until()``,
    the caller's own requirement, polled in the parent) is not certain within
    ``seconds``: the workers then go on for up to ``overtime_s``, forcing what
    is missing (a worker's forced puts exceed any capacity, so commits evict),
    until everything is exercised. Raises :class:`NotExercised` (after every
    correctness check passed) only if even that did not: the caller runs again
    with another seed (:func:`until_exercised`).

    Args:
        capacity_chunks: capacity in largest-chunk sizes.
        grace_s: ``evict_grace_s``. At 0.2 s nearly every put is rejected (every
            resident chunk is read within the grace); 0.02-0.05 s mixes
            rejections with hundreds of evictions a second.
        fault_after_s: worker 0 raises after this long (tests the harness).
        until: the caller's requirement, polled after each ``during()``.
        overtime_s: the most the workers run past ``seconds`` to exercise
            MP_REQUIRED and ``until``.

    Returns:
        A summary: summed tallies and counters, capacity figures, sample maxima.
    """
    spec = tiny_spec()
    chunk_max = max_chunk_bytes(spec, MP_MAX_BLOCKS)
    capacity = int(capacity_chunks * chunk_max)
    config_kwargs: dict[str, Any] = {
        "cache_dir": cache_dir,
        "capacity": capacity,
        "evict_grace_s": grace_s,
        "fsync": fsync,
        "ring_size": "4MiB",
    }
    where = (
        f"run_multiprocess(mode={mode}, seed={seed}, workers={workers}, "
        f"seconds={seconds})"
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The parent joins the barrier too: it opens its sampling handle only once
    # every worker has opened (the workers race on creating the directory).
    barrier = ctx.Barrier(workers + 1)
    # One flag per MP_REQUIRED name (set by any worker), then the parent's.
    exercised = ctx.Array("b", len(MP_REQUIRED) + 1, lock=False)
    exercised[-1] = int(until is None)
    procs = [
        ctx.Process(
            target=_mp_worker,
            args=(
                wid,
                config_kwargs,
                seed,
                seconds,
                fault_after_s,
                barrier,
                results,
                mode,
                exercised,
                overtime_s,
            ),  # fmt: skip
            name=f"npukv-mp-worker-{wid}",
            daemon=True,
        )
        for wid in range(workers)
    ]
    reports: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    parent_max = disk_max = 0
    samples = 0
    try:
        for proc in procs:
            proc.start()
        try:
            barrier.wait(timeout=180)
        except threading.BrokenBarrierError:
            _drain(results, reports, errors, timeout=5.0)
            raise AssertionError(
                f"{where}: workers did not all start:\n" + "\n".join(errors)
            ) from None
        sampler = KVStore(StoreConfig(**config_kwargs), spec)
        deadline = time.monotonic() + seconds + overtime_s + 120
        while len(reports) + len(errors) < workers:
            if time.monotonic() > deadline:
                raise AssertionError(f"{where}: workers did not finish in time")
            parent_max = max(parent_max, sampler.stats().total_bytes)
            # Informational: files exceed the ledger by chunks in their publish
            # window and victims not yet unlinked.
            disk_max = max(disk_max, chunk_bytes_on_disk(cache_dir))
            samples += 1
            if during is not None:
                during()
            if not exercised[-1] and until is not None and until():
                exercised[-1] = 1
            _drain(results, reports, errors, timeout=0.005)
            if any(not p.is_alive() and p.exitcode != 0 for p in procs):
                _drain(results, reports, errors, timeout=1.0)
                if len(reports) + len(errors) < workers:
                    codes = [p.exitcode for p in procs]
                    errors.append(
                        f"a worker died without reporting: exit codes {codes}"
                    )
                    break
        sampler.close()
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
        results.join_thread()
    if errors:
        raise AssertionError(f"{where}: worker errors:\n" + "\n".join(errors))
    codes = [p.exitcode for p in procs]
    if any(codes):
        raise AssertionError(f"{where}: worker exit codes {codes}")

    _fail(where, [p for r in reports.values() for p in r["problems"]])
    totals: Counter[str] = Counter()
    for report in reports.values():
        totals.update(report["tally"])
        totals.update({f"counter.{k}": v for k, v in report["counters"].items()})
    worker_max = max(r["max_total"] for r in reports.values())
    bound = capacity + chunk_max
    summary = {
        "seed": seed,
        "capacity": capacity,
        "chunk_max": chunk_max,
        "max_total_workers": worker_max,
        "max_total_parent": parent_max,
        "max_disk_bytes_parent": disk_max,
        "parent_samples": samples,
        "totals": dict(totals),
    }
    problems = []
    if max(worker_max, parent_max) > bound:
        problems.append(
            f"total_bytes reached {max(worker_max, parent_max)}, capacity {capacity} "
            f"+ one chunk {chunk_max} = {bound}"
        )
    # A checksum mismatch or unreadable header means the store handed a
    # verifying reader bytes that were not the key's: never expected here.
    for name in ("counter.checksum_errors", "counter.read_errors"):
        if totals[name]:
            problems.append(f"{name} = {totals[name]}, expected 0")
    _fail(f"{where} summary {summary}", problems)

    store = KVStore(StoreConfig(**config_kwargs), spec)
    try:
        problems = verify_store(store)
        if store.stats().total_bytes > capacity:
            problems.append(
                f"after the run total {store.stats().total_bytes} > {capacity}"
            )
        summary["final_chunks"] = store.stats().num_chunks
    finally:
        store.close()
    problems += [f"tmp/ left {name}" for name in tmp_files(cache_dir)]
    _fail(f"{where} after reopen", problems)
    # The scenario must have exercised what it claims to (it found no fault).
    missing = [name for name in MP_REQUIRED if not totals[name]]
    if until is not None and not until():
        missing.append("the caller's until()")
    if missing:
        raise NotExercised(
            f"{where}: no fault found, but even {overtime_s:g} s of overtime did "
            f"not exercise {missing}; summary {summary}"
        )
    return summary


def until_exercised(
    attempt: Callable[[int], dict[str, Any]], attempts: int = 3
) -> dict[str, Any]:
    """``attempt(n)`` for n = 0, 1, ... (each a whole randomized run, on its
    own seed and directory): the summary of the first that exercised what it
    checks. A run that raises :class:`NotExercised` found no fault and is run
    again; any other failure propagates at once."""
    skipped: list[str] = []
    for number in range(attempts):
        try:
            return attempt(number)
        except NotExercised as exc:
            skipped.append(str(exc))
    raise AssertionError(
        f"{attempts} runs found no fault, but none exercised what the test "
        "checks:\n" + "\n".join(skipped)
    )


def _drain(
    results, reports: dict[int, dict[str, Any]], errors: list[str], timeout: float
) -> None:
    """Move every queued worker message into ``reports`` / ``errors``."""
    wait = timeout
    while True:
        try:
            kind, wid, payload = results.get(timeout=wait)
        except queue.Empty:
            return
        if kind == "ok":
            reports[wid] = payload
        else:
            errors.append(f"worker {wid} raised:\n{payload}")
        wait = 0.0


# -- scenario 2: a writer SIGKILLed mid-put ------------------------------------

# Publish phases the hooked child announces in shared memory (see _install_hooks).
PHASE_IDLE = 0
PHASE_TMP_WRITTEN = 1  # chunk bytes in tmp/, fsync about to run, not renamed
PHASE_RENAMED = 2  # chunk file in <ns>/chunks/, not yet committed
PHASE_IN_TXN = 3  # inside the LMDB write transaction, holding the write lock
PHASE_EVICTING = 4  # inside the transaction, unpublishing a victim
PHASE_COMMITTED = 5  # committed without evicting, put() not returned
PHASE_EVICTED = 6  # committed with victims, their files not unlinked yet
PHASE_NAMES = {
    PHASE_IDLE: "idle",
    PHASE_TMP_WRITTEN: "tmp-written",
    PHASE_RENAMED: "renamed",
    PHASE_IN_TXN: "in-txn",
    PHASE_EVICTING: "evicting",
    PHASE_COMMITTED: "committed",
    PHASE_EVICTED: "evicted",
}
CRASH_MAX_BLOCKS = 4
#: The child waits this long in the targeted phase: the parent kills it there
#: long before, so where the kill lands does not depend on scheduling.
_TARGET_NAP_S = 60.0


@dataclass(frozen=True)
class CrashTrial:
    """One kill: ``hooks`` widens the publish windows in the child; ``target``
    kills on entering that phase, else after ``delay_s`` from ready."""

    hooks: bool
    target: int | None = None
    delay_s: float = 0.0
    skip_puts: int = 0  # targeted: puts that pass the target phase unharmed

    def describe(self) -> str:
        if self.target is not None:
            return f"targeted:{PHASE_NAMES[self.target]}@put{self.skip_puts}"
        return f"{'widened' if self.hooks else 'plain'}:{self.delay_s * 1e3:.0f}ms"


def random_plan(
    trials: int, rng: random.Random, max_delay_s: float = 0.15
) -> list[CrashTrial]:
    """Random-delay kills, alternating plain and widened children."""
    return [
        CrashTrial(hooks=bool(i % 2), delay_s=rng.uniform(0, max_delay_s))
        for i in range(trials)
    ]


def targeted_plan(phases: Sequence[int], repeats: int = 1) -> list[CrashTrial]:
    """One kill per phase, ``repeats`` times; the kill hits put 0, 1, 2 or 3 of
    the child, so the store holds earlier puts of the same trial."""
    return [
        CrashTrial(hooks=True, target=p, skip_puts=(r + i) % 4)
        for r in range(repeats)
        for i, p in enumerate(phases)
    ]


#: The windows of a put without eviction, and those of an evicting put.
PUBLISH_PHASES = (PHASE_TMP_WRITTEN, PHASE_RENAMED, PHASE_IN_TXN, PHASE_COMMITTED)
EVICT_PHASES = (PHASE_IN_TXN, PHASE_EVICTING, PHASE_EVICTED)


def mixed_plan(
    trials: int,
    rng: random.Random,
    phases: Sequence[int],
    targeted_share: float = 1 / 3,
    max_delay_s: float = 0.15,
) -> list[CrashTrial]:
    """``trials`` kills in random order: a share targeted at ``phases`` (round
    robin), the rest at random delays (plain and widened alternating)."""
    targeted = round(trials * targeted_share)
    repeats = -(-targeted // len(phases)) if targeted else 0
    plan = targeted_plan(phases, repeats)[:targeted]
    plan += random_plan(trials - targeted, rng, max_delay_s)
    rng.shuffle(plan)
    return plan


def crash_batch_keys(trial_seed: int, batch: int) -> list[bytes]:
    """The keys of put number ``batch`` of a child; 1-4 keys, some of them from
    a pool shared by all trials (so puts skip stored keys and chunks end up with
    dead rows)."""
    rng = random.Random(f"crash:{trial_seed}:{batch}")
    keys: list[bytes] = []
    for j in range(rng.randint(1, CRASH_MAX_BLOCKS)):
        if rng.random() < 0.3:
            name = f"pool:{rng.randrange(12)}"
        else:
            name = f"own:{trial_seed}:{batch}:{j}"
        key = hashlib.blake2b(name.encode(), digest_size=16).digest()
        if key not in keys:
            keys.append(key)
    return keys


def _install_hooks(
    phase, rng: random.Random, target: int | None, armed: list[bool]
) -> None:
    """Wrap the publish steps of this (child) process: announce each phase in
    ``phase``; without ``target`` nap 0-3 ms in each, with one wait in
    ``target`` until killed, once ``armed[0]`` is set (before that, stay quiet so
    the parent does not kill early)."""
    import npukv_store.store.index as index_mod

    def enter(value: int) -> None:
        if target is None:
            phase.value = value
            time.sleep(rng.uniform(0, 0.003))
        elif armed[0]:
            phase.value = value
            if value == target:
                time.sleep(_TARGET_NAP_S)

    real_fsync, real_rename = os.fsync, os.rename
    real_commit = index_mod.Index.commit_chunk
    real_touch_in = index_mod.Index._touch_in
    real_unpublish_in = index_mod.Index._unpublish_in

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):  # the tmp chunk, not the dir
            enter(PHASE_TMP_WRITTEN)
        real_fsync(fd)

    def rename(src, dst, **kwargs):
        real_rename(src, dst, **kwargs)
        if str(dst).endswith(".safetensors"):
            enter(PHASE_RENAMED)

    def touch_in(self, txn, chunk_ids, now_ns):
        enter(PHASE_IN_TXN)  # the first step of every commit transaction
        return real_touch_in(self, txn, chunk_ids, now_ns)

    def unpublish_in(self, txn, record):
        enter(PHASE_EVICTING)
        return real_unpublish_in(self, txn, record)

    def commit_chunk(self, record, **kwargs):
        result = real_commit(self, record, **kwargs)
        enter(PHASE_EVICTED if result.victims else PHASE_COMMITTED)
        return result

    os.fsync, os.rename = fsync, rename
    index_mod.Index.commit_chunk = commit_chunk
    index_mod.Index._touch_in = touch_in
    index_mod.Index._unpublish_in = unpublish_in


def _crash_writer(
    config_kwargs: dict[str, Any],
    trial_seed: int,
    log_path: str,
    hooks: bool,
    target: int | None,
    skip_puts: int,
    ready,
    phase,
    mode: str = "sync",
) -> None:
    """Child: put batches forever (``mode`` as in :func:`do_put`); after each
    put *returns*, append one line ``batch stored skipped rejected`` to
    ``log_path`` (a SIGKILL cannot lose a completed write(2); the parent only
    needs the kernel to have it)."""
    try:
        spec = tiny_spec()
        store = KVStore(StoreConfig(**config_kwargs), spec)
        armed = [False]
        if hooks:  # after open: the marker's own fsync is no publish phase
            rng = random.Random(f"naps:{trial_seed}")
            _install_hooks(phase, rng, target, armed)
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        ready.set()
        deadline = time.monotonic() + 120  # never outlive a parent that forgot us
        batch = 0
        while time.monotonic() < deadline:
            keys = crash_batch_keys(trial_seed, batch)
            tensors = make_tensors(spec, keys)
            armed[0] = batch >= skip_puts
            result = do_put(store, keys, tensors, mode)
            phase.value = PHASE_IDLE
            line = f"{batch} {result.stored} {result.skipped} {result.rejected}\n"
            os.write(fd, line.encode())
            batch += 1
    except BaseException:
        with open(log_path + ".err", "w", encoding="utf-8") as handle:
            handle.write(traceback.format_exc())
        raise


def _read_log(log_path: str) -> list[tuple[int, int, int, int]]:
    """Complete lines of a child's log (a torn last line is not a return)."""
    try:
        with open(log_path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # the part after the last newline is torn
    return [tuple(int(x) for x in line.split()) for line in lines]  # type: ignore[misc]


def _unindexed_chunks(cache_dir: str, config: StoreConfig) -> int:
    """Chunk files the index does not know, looked at before recovery runs."""
    index = Index(
        CacheDir(cache_dir).index_path, map_size=config.index_map_size, sync=False
    )
    try:
        published = {r.chunk_id for r in index.iter_chunks()}
    finally:
        index.close()
    return len(set(chunk_files(cache_dir)) - published)


def run_crash_trials(
    cache_dir: str,
    log_dir: str,
    plan: Sequence[CrashTrial],
    *,
    evict: bool = False,
    seed: int = 0,
    mode: str = "sync",
) -> dict[str, Any]:
    """Run ``plan``: each trial spawns a writer, SIGKILLs it, reopens and checks.
    With ``mode="async"`` the writer stages through the ring and a put "returns"
    when its ``flush()`` does; kills then land on the background writer thread.

    All trials share ``cache_dir``, so each reopen also re-verifies what earlier
    trials left. Without ``evict`` the capacity is far above what the trials
    write, so every put whose return was logged must stay readable; with
    ``evict`` the capacity holds a few chunks and ``evict_grace_s=0``, so nearly
    every put evicts and only "hit means right bytes" is checked.

    Returns:
        A summary: trials, kills per phase, puts returned, leftovers seen.
    """
    spec = tiny_spec()
    chunk_max = max_chunk_bytes(spec, CRASH_MAX_BLOCKS)
    capacity = 5 * chunk_max if evict else 1 << 30
    config_kwargs: dict[str, Any] = {
        "cache_dir": cache_dir,
        "capacity": capacity,
        "evict_grace_s": 0.0 if evict else 5.0,
        "fsync": "chunk",
        "ring_size": "4MiB",
    }
    config = StoreConfig(**config_kwargs)
    ctx = mp.get_context("spawn")
    returned: list[bytes] = []  # keys of every put whose return was logged
    summary: Counter[str] = Counter()
    os.makedirs(log_dir, exist_ok=True)
    for number, trial in enumerate(plan):
        trial_seed = seed * 100_003 + number
        where = (
            f"run_crash_trials(seed={seed}, evict={evict}) trial {number} "
            f"({trial.describe()})"
        )
        log_path = os.path.join(log_dir, f"trial-{number}.log")
        ready = ctx.Event()
        phase = ctx.Value("i", PHASE_IDLE, lock=False)
        proc = ctx.Process(
            target=_crash_writer,
            args=(
                config_kwargs,
                trial_seed,
                log_path,
                trial.hooks,
                trial.target,
                trial.skip_puts,
                ready,
                phase,
                mode,
            ),
            name=f"npukv-crash-writer-{number}",
            daemon=True,
        )
        proc.start()
        try:
            _kill_at(proc, trial, ready, phase, log_path, where)
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=30)
        if proc.exitcode != -signal.SIGKILL:
            raise AssertionError(
                f"{where}: writer exit code {proc.exitcode}, expected SIGKILL\n"
                + _child_error(log_path)
            )
        last_phase = phase.value
        if trial.target is not None and last_phase != trial.target:
            raise AssertionError(
                f"{where}: the kill landed in phase {PHASE_NAMES[last_phase]}, "
                "not the targeted one"
            )
        summary[f"killed_in.{PHASE_NAMES[last_phase]}"] += 1
        # What the crash left, before recovery cleans it (proves the trial
        # exercised recovery, and is summed over the run).
        dead_tmp = [n for n in tmp_files(cache_dir) if n.startswith(f"{proc.pid}-")]
        unindexed = _unindexed_chunks(cache_dir, config)
        summary["tmp_files_left_by_kill"] += len(dead_tmp)
        summary["unindexed_chunks_left_by_kill"] += unindexed
        problems = _leftover_problems(trial.target, dead_tmp, unindexed)

        log = _read_log(log_path)
        summary["puts_returned"] += len(log)
        trial_keys = []
        for batch, stored, _skipped, rejected in log:
            keys = crash_batch_keys(trial_seed, batch)
            trial_keys += keys
            summary["blocks_stored"] += stored
            if rejected and not evict:
                raise AssertionError(f"{where}: put {batch} rejected {rejected} rows")
        if not evict:
            returned += trial_keys
        # The put in flight when the child died: its keys may or may not be
        # there, but a hit must have the right bytes.
        in_flight = crash_batch_keys(trial_seed, len(log))

        store = KVStore(config, spec)  # recovery runs here
        try:
            problems += verify_store(store)
            if trial.target == PHASE_COMMITTED:
                # Killed after a commit that evicted nothing: the put did not
                # return, but every key of it is in the index and must read.
                problems += read_and_verify(store, in_flight, expect_all=True)
            elif trial.target == PHASE_EVICTED:
                # The commit won a row (it evicts only then); a key this put
                # skipped as stored may have been among the victims.
                problems += _some_readable(store, in_flight)
            problems += read_and_verify(store, in_flight + trial_keys, expect_all=False)
            problems += read_and_verify(store, returned, expect_all=not evict)
            if not evict:
                problems += _lookup_problems(store, log, trial_seed)
            stats = store.stats()
            if stats.total_bytes > capacity:
                problems.append(f"total {stats.total_bytes} > capacity {capacity}")
            orphans = set(chunk_files(cache_dir)) - {
                r.chunk_id for r in store.index.iter_chunks()
            }
        finally:
            store.close()
        # Every creator is dead now, so recovery must have removed every orphan
        # chunk and every tmp file (the reopen leaves none of its own either).
        problems += [f"orphan chunk file {cid:016x} survived reopen" for cid in orphans]
        problems += [
            f"tmp/ file {name} survived reopen" for name in tmp_files(cache_dir)
        ]
        _fail(where, problems)
    summary["trials"] = len(plan)
    summary["returned_keys_verified"] = len(set(returned))
    _final_write_check(config, spec, seed)
    return dict(summary)


def _kill_at(proc, trial: CrashTrial, ready, phase, log_path: str, where: str) -> None:
    if not ready.wait(timeout=120):
        raise AssertionError(
            f"{where}: writer never became ready\n" + _child_error(log_path)
        )
    if trial.target is None:
        time.sleep(trial.delay_s)
    else:
        # Entering the target phase needs a working index; a write lock left
        # stuck by an earlier kill shows up here as no progress.
        deadline = time.monotonic() + 30
        while phase.value != trial.target:
            if not proc.is_alive():
                raise AssertionError(f"{where}: writer died\n" + _child_error(log_path))
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{where}: writer never reached the phase (stuck in "
                    f"{PHASE_NAMES[phase.value]}: index write lock not recovered? "
                    "or the store no longer publishes through os.fsync, "
                    "os.rename and Index.commit_chunk, which the hooks wrap)"
                )
            time.sleep(0.0002)
    os.kill(proc.pid, signal.SIGKILL)


def _leftover_problems(
    target: int | None, dead_tmp: list[str], unindexed: int
) -> list[str]:
    """What a kill in ``target`` must leave for recovery, if it did not."""
    if target == PHASE_TMP_WRITTEN and len(dead_tmp) != 1:
        return [f"killed after the tmp write, found tmp files {dead_tmp}"]
    if target in (PHASE_RENAMED, PHASE_EVICTED) and unindexed < 1:
        return ["killed between rename/evict and unlink, found no unindexed chunk"]
    return []


def _some_readable(store: KVStore, keys: list[bytes]) -> list[str]:
    out = empty_out(store.spec, len(keys))
    if any(store.read(keys, out)):
        return []
    return [f"none of the committed put's keys {[k.hex() for k in keys]} reads"]


def _child_error(log_path: str) -> str:
    try:
        with open(log_path + ".err", encoding="utf-8") as handle:
            return "child traceback:\n" + handle.read()
    except FileNotFoundError:
        return "(the child wrote no traceback)"


def _lookup_problems(
    store: KVStore, log: Sequence[tuple[int, int, int, int]], trial_seed: int
) -> list[str]:
    problems = []
    for batch, *_ in log:
        keys = crash_batch_keys(trial_seed, batch)
        found = store.lookup(keys)
        if found != len(keys):
            problems.append(f"lookup of returned put {batch}: {found} of {len(keys)}")
    return problems


def _final_write_check(config: StoreConfig, spec: NamespaceSpec, seed: int) -> None:
    """After the last kill, a put must still commit: the LMDB write lock of a
    writer killed inside its transaction was recovered. Run in a thread so a
    stuck lock fails the scenario instead of hanging it."""
    key = hashlib.blake2b(f"canary:{seed}:{time.time_ns()}".encode(), digest_size=16)
    keys = [key.digest()]
    outcome: list[object] = []

    def attempt() -> None:
        try:
            with KVStore(config, spec) as store:
                store.put(keys, make_tensors(spec, keys))
                outcome.append(read_and_verify(store, keys, expect_all=True))
                outcome.append(store.check())
        except BaseException as exc:  # reported below
            outcome.append(exc)

    thread = threading.Thread(target=attempt, name="npukv-canary", daemon=True)
    thread.start()
    thread.join(timeout=60)
    if thread.is_alive():
        raise AssertionError(
            "a put after the kills did not finish in 60 s: index lock stuck"
        )
    if outcome and isinstance(outcome[0], BaseException):
        raise AssertionError(
            f"a put after the kills raised {outcome[0]!r}"
        ) from outcome[0]
    _fail("the canary put after the kills", [*outcome[0], *outcome[1]])  # type: ignore[misc]


def run_live_creator_eviction_crash(cache_dir: str, seed: int = 0) -> dict[str, Any]:
    """This process writes two chunks and stays alive; a child evicts them and
    is SIGKILLed after its evicting commit, before it unlinks their files.

    Returns:
        After reopen: ``orphans`` (chunk files the index does not know),
        ``bytes_on_disk``, ``ledger_bytes``, ``capacity`` and ``check``.
    """
    spec = tiny_spec()
    capacity = 2 * max_chunk_bytes(spec, CRASH_MAX_BLOCKS)
    config_kwargs: dict[str, Any] = {
        "cache_dir": cache_dir,
        "capacity": capacity,
        "evict_grace_s": 0.0,
        "fsync": "chunk",
    }
    config = StoreConfig(**config_kwargs)
    with KVStore(config, spec) as store:
        for batch in range(2):
            keys = crash_batch_keys(seed + 1, batch)
            store.put(keys, make_tensors(spec, keys))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    phase = ctx.Value("i", PHASE_IDLE, lock=False)
    log_path = os.path.join(os.path.dirname(cache_dir), "evicter.log")
    trial = CrashTrial(hooks=True, target=PHASE_EVICTED)
    proc = ctx.Process(
        target=_crash_writer,
        args=(config_kwargs, seed + 2, log_path, True, PHASE_EVICTED, 0, ready, phase),
        name="npukv-evicter",
        daemon=True,
    )
    proc.start()
    try:
        _kill_at(proc, trial, ready, phase, log_path, "run_live_creator_eviction_crash")
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=30)
    with KVStore(config, spec) as store:  # recovery runs here
        indexed = {r.chunk_id for r in store.index.iter_chunks()}
        found = {
            "orphans": sorted(
                f"{cid:016x}" for cid in set(chunk_files(cache_dir)) - indexed
            ),
            "bytes_on_disk": chunk_bytes_on_disk(cache_dir),
            "ledger_bytes": store.stats().total_bytes,
            "capacity": capacity,
            "check": store.check(),
        }
    return found
