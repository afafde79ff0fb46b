"""Scenario 1: concurrent workers on one small cache.

``workers`` spawned processes (multiprocess_worker.py) put, look up and read
prompts that share prefixes, so they race on the same keys while commits
evict; see :func:`run_multiprocess` for what a run proves.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from npukv_store import KVStore, StoreConfig
from tests.support.chunks import chunk_bytes_on_disk, max_chunk_bytes, tmp_files
from tests.support.scenarios.multiprocess_worker import (
    MP_MAX_BLOCKS,
    MP_REQUIRED,
    run_worker,
)
from tests.support.scenarios.oracles import SPEC, fail, verify_store


class NotExercised(AssertionError):
    """A randomized run found no fault but did not exercise what it checks,
    even with its overtime: run it again (another seed), do not pass it."""


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
    spec = SPEC
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
            target=run_worker,
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

    fail(where, [p for r in reports.values() for p in r["problems"]])
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
    fail(f"{where} summary {summary}", problems)

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
    fail(f"{where} after reopen", problems)
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
