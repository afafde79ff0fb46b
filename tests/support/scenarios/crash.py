"""Scenario 2: a writer SIGKILLed mid-put (its plan: crash_plan.py).

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
import random
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from typing import Any

from npukv_store import KVStore, NamespaceSpec, StoreConfig
from npukv_store.store.directory import CacheDir
from npukv_store.store.index import Index
from tests.support.blocks import block_tensors, empty_blocks
from tests.support.chunks import (
    chunk_bytes_on_disk,
    chunk_files,
    max_chunk_bytes,
    tmp_files,
)
from tests.support.scenarios.crash_plan import (
    CRASH_MAX_BLOCKS,
    PHASE_COMMITTED,
    PHASE_EVICTED,
    PHASE_IDLE,
    PHASE_NAMES,
    PHASE_RENAMED,
    PHASE_TMP_WRITTEN,
    CrashTrial,
    crash_batch_keys,
    install_hooks,
)
from tests.support.scenarios.oracles import (
    SPEC,
    do_put,
    fail,
    read_and_verify,
    verify_store,
)


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
        spec = SPEC
        store = KVStore(StoreConfig(**config_kwargs), spec)
        armed = [False]
        if hooks:  # after open: the marker's own fsync is no publish phase
            rng = random.Random(f"naps:{trial_seed}")
            install_hooks(phase, rng, target, armed)
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        ready.set()
        deadline = time.monotonic() + 120  # never outlive a parent that forgot us
        batch = 0
        while time.monotonic() < deadline:
            keys = crash_batch_keys(trial_seed, batch)
            tensors = block_tensors(spec, keys)
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


def read_log(log_path: str) -> list[tuple[int, int, int, int]]:
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
    spec = SPEC
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

        log = read_log(log_path)
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
        fail(where, problems)
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
    out = empty_blocks(store.spec, len(keys))
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
                store.put(keys, block_tensors(spec, keys))
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
    fail("the canary put after the kills", [*outcome[0], *outcome[1]])  # type: ignore[misc]


def run_live_creator_eviction_crash(cache_dir: str, seed: int = 0) -> dict[str, Any]:
    """This process writes two chunks and stays alive; a child evicts them and
    is SIGKILLed after its evicting commit, before it unlinks their files.

    Returns:
        After reopen: ``orphans`` (chunk files the index does not know),
        ``bytes_on_disk``, ``ledger_bytes``, ``capacity`` and ``check``.
    """
    spec = SPEC
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
            store.put(keys, block_tensors(spec, keys))
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
