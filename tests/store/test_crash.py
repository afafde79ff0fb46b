"""SIGKILL a writer mid-put: after reopen the directory is whole and nothing is lost.

A ``spawn``ed child puts 1-4 block chunks in a loop with ``fsync="chunk"`` and
logs each put only after it returned; the parent SIGKILLs it, reopens the store
(recovery runs) and checks (``run_crash_trials``): ``check(verify_data=
True)`` is empty; tmp/ is empty (the dead pid's in-flight file is gone); no
orphan chunk file is left; every indexed key reads back with its own bytes; every
put whose return was logged is still fully readable and found by lookup (when the
capacity evicts nothing); a put after the last kill still commits (the LMDB write
lock of a writer killed inside its transaction was recovered).

Trial classes (details in ``tests/support/scenarios/crash_plan.py``):

* ``test_sigkill_at_random_points``: 10 kills at uniform 0-150 ms after the child
  is ready, alternating a plain child and one whose publish steps nap 0-3 ms
  (widening the rename-to-commit and in-transaction windows), and one kill in
  a child's third put (so returned puts are always checked after a kill).
* ``test_sigkill_in_each_publish_window``: kills placed exactly in each window:
  tmp written, renamed but not committed, inside the write transaction,
  committed but not returned; each window's leftover is asserted to exist
  before recovery removes it.
* ``test_sigkill_during_eviction``: a cache of five chunks with no grace, so
  every put evicts; kills inside the evicting transaction, after it commits but
  before the victims' files are unlinked, and at random.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys

import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.maintenance import Options, run
from npukv_store.store import recovery
from npukv_store.store.index import Index
from tests.support.blocks import block_tensors, empty_blocks, verify_read
from tests.support.chunks import chunk_files
from tests.support.scenarios.crash import (
    run_crash_trials,
    run_live_creator_eviction_crash,
)
from tests.support.scenarios.crash_plan import (
    EVICT_PHASES,
    PHASE_NAMES,
    PHASE_TMP_WRITTEN,
    PUBLISH_PHASES,
    CrashTrial,
    crash_batch_keys,
    random_plan,
    targeted_plan,
)
from tests.support.scenarios.oracles import SPEC, verify_store

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("mode", "trials"), [("sync", 10), ("async", 20)])
def test_sigkill_at_random_points(tmp_path, mode, trials):
    """async: the child stages through the ring and flushes; kills land in the
    background writer's flush (at least 20 trials, as the data path asks)."""
    seed = random.randrange(2**32)  # every failure message names it
    plan = random_plan(trials, random.Random(seed), max_delay_s=0.15)
    # Random kills may all land before a put returns: one more trial, killed
    # in its third put, makes sure returned puts are checked after a kill.
    plan.append(CrashTrial(hooks=True, target=PHASE_TMP_WRITTEN, skip_puts=2))
    summary = run_crash_trials(
        str(tmp_path / "cache"), str(tmp_path / "logs"), plan, seed=seed, mode=mode
    )
    assert summary["trials"] == trials + 1
    # The children got some puts through, and those were checked after kills.
    assert summary["puts_returned"] >= 2, summary
    assert summary["returned_keys_verified"] > 0, summary


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_in_each_publish_window(tmp_path, mode):
    seed = random.randrange(2**32)
    plan = targeted_plan(PUBLISH_PHASES, repeats=2)
    summary = run_crash_trials(
        str(tmp_path / "cache"), str(tmp_path / "logs"), plan, seed=seed, mode=mode
    )
    for phase in PUBLISH_PHASES:
        assert summary[f"killed_in.{PHASE_NAMES[phase]}"] == 2, summary
    # Recovery had real leftovers to remove: the dead writers' tmp files and
    # the renamed-but-uncommitted chunks.
    assert summary["tmp_files_left_by_kill"] >= 2, summary
    assert summary["unindexed_chunks_left_by_kill"] >= 2, summary


@pytest.mark.timeout(120)
def test_sigkill_during_eviction(tmp_path):
    seed = random.randrange(2**32)
    plan = targeted_plan(EVICT_PHASES, repeats=2)
    plan += random_plan(4, random.Random(seed), max_delay_s=0.15)
    summary = run_crash_trials(
        str(tmp_path / "cache"), str(tmp_path / "logs"), plan, evict=True, seed=seed
    )
    for phase in EVICT_PHASES:
        assert summary[f"killed_in.{PHASE_NAMES[phase]}"] >= 2, summary
    # Killed between the evicting commit and the unlinks: victim files left.
    assert summary["unindexed_chunks_left_by_kill"] >= 2, summary


@pytest.mark.timeout(120)
def test_sigkill_after_evicting_a_live_processes_chunks(tmp_path):
    """Regression scenario: this process (alive) writes two chunks; a child
    evicts them and is SIGKILLed after its commit, before unlinking them. After
    reopen every chunk file on disk must be indexed, else the disk holds more
    than the ledger (and the capacity) says until tmp_max_age_s passes."""
    found = run_live_creator_eviction_crash(str(tmp_path / "cache"))
    assert found["orphans"] == [], found
    assert found["bytes_on_disk"] == found["ledger_bytes"], found


def test_oracle_catches_a_flipped_byte(tmp_path):
    """The checks above can fail: one flipped data byte in a chunk is reported by
    verify_store (check with data, and the read miss), and a reader that trusts
    the disk gets wrong bytes that verify_read reports."""
    spec = SPEC
    config = StoreConfig(cache_dir=str(tmp_path / "cache"), fsync="never")
    keys = crash_batch_keys(7, 0)
    with KVStore(config, spec) as store:
        store.put(keys, block_tensors(spec, keys))
        assert verify_store(store) == []
    (path,) = chunk_files(config.cache_dir).values()
    with open(path, "r+b") as handle:  # last data byte before the checksum table
        handle.seek(os.path.getsize(path) - 8 * len(spec.layers) * len(keys) - 1)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    trusting = StoreConfig(cache_dir=config.cache_dir, fsync="never", verify="never")
    with KVStore(trusting, spec) as store:
        out = empty_blocks(spec, len(keys))
        ok = store.read(keys, out)
        assert all(ok)
        problems = verify_read(spec, keys, out, ok)
        assert len(problems) == 1, problems
        assert "wrong bytes" in problems[0]
    with KVStore(config, spec) as store:  # (the miss quarantines the chunk)
        problems = verify_store(store)
        assert any("checksum" in p for p in problems), problems
        assert any("read() missed" in p for p in problems), problems


def _distinct_keys(chunk: int) -> list[bytes]:
    """Three keys no other chunk holds: each put makes one chunk."""
    return [hashlib.blake2b(b"rebuild:%d:%d" % (chunk, i), digest_size=16).digest()
            for i in range(3)]  # fmt: skip


REBUILD_KILLED = """
import os, signal, sys
from npukv_store.store import recovery
from npukv_store.store.directory import CacheDir
from npukv_store.store.index import Index
recovery.REBUILD_BATCH = int(sys.argv[2])
real = Index.commit_rebuilt
calls = [0]
def killed(self, records):
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)  # mid-rebuild, between batches
    return real(self, records)
Index.commit_rebuilt = killed
cdir = CacheDir(sys.argv[1])
cdir.open()
recovery.rebuild_index(cdir, map_size=1 << 30, sync=True)
"""


def _stored_then_rebuild_killed(
    root: str, fsync: str, chunks: int, batch: int, killed_at: int
) -> tuple[StoreConfig, list[list[bytes]]]:
    """``chunks`` one-chunk puts, then a rebuild in batches of ``batch``
    chunks SIGKILLed before its ``killed_at``-th batch; the config and the
    keys of each chunk."""
    config = StoreConfig(cache_dir=root, fsync=fsync)
    with KVStore(config, SPEC) as store:
        batches = [_distinct_keys(n) for n in range(chunks)]
        for keys in batches:
            store.put(keys, block_tensors(SPEC, keys))
    done = subprocess.run(
        [sys.executable, "-c", REBUILD_KILLED, root, str(batch), str(killed_at)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr
    return config, batches


@pytest.mark.timeout(120)
def test_sigkill_during_a_batched_rebuild_loses_nothing(tmp_path):
    """A rebuild (batches of 3 chunks) SIGKILLed before its third batch: the
    two batches it committed stay published, no chunk file is deleted while
    its mark stands (a gc finds no orphan in a half-built index), and the
    next open finishes the job: every stored key reads back exact."""
    root = str(tmp_path / "cache")
    config, batches = _stored_then_rebuild_killed(root, "chunk", 10, 3, 3)
    files = set(chunk_files(root).values())
    assert len(files) == 10
    index = Index(os.path.join(root, "index"), map_size=1 << 30, sync=False)
    try:
        assert len(list(index.iter_chunks())) == 6  # two batches published
        assert recovery.REBUILD_MARK in index.meta_records(recovery.REBUILD_MARK)
    finally:
        index.close()
    # A gc over the half-built index (its rebuilder dead, its mark standing)
    # finishes the rebuild on open, and deletes no chunk file.
    run(Options(cache_dir=root, gc_only=True, ring_dir=str(tmp_path)))
    assert set(chunk_files(root).values()) == files
    with KVStore(config, SPEC) as store:
        assert store.index.meta_records(recovery.REBUILD_MARK) == {}
        for keys in batches:
            out = empty_blocks(SPEC, len(keys))
            assert verify_read(SPEC, keys, out, store.read(keys, out)) == []
        assert store.check(verify_data=True) == []


@pytest.mark.timeout(120)
def test_a_rebuild_killed_then_opened_is_finished_by_the_opener(tmp_path):
    """The same kill, then a store open (not gc) takes the rebuild over."""
    config, batches = _stored_then_rebuild_killed(
        str(tmp_path / "cache"), "never", 7, 2, 2
    )
    with KVStore(config, SPEC) as store:
        assert store.index.meta_records(recovery.REBUILD_MARK) == {}
        for keys in batches:
            assert store.lookup(keys) == len(keys)
        assert store.check(verify_data=True) == []
