"""Save claims across processes (npukv_store/store/claims.py).

Two processes that compute the same prefix at once must write it once: the
second finds the first's claims and writes nothing for those blocks. A claim of
a dead or stuck process must not block a block for good.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import pytest

from bench.harness.processes import reap, reaping
from npukv_store import KVStore, StoreConfig
from npukv_store.store import store as store_module
from npukv_store.store.claims import CLAIM_TTL_S, ClaimTable
from npukv_store.store.write import chunk_file as chunk_writer
from tests.support.blocks import block_tensors, tiny_spec

pytestmark = pytest.mark.integration

CTX = mp.get_context("spawn")


def _slow_saver(cache_dir, keys, mode, barrier, results):
    """Save ``keys`` after the barrier; every chunk write takes 0.3 s, so two
    savers overlap for certain. Reports (chunk files written, put result)."""
    writes = []
    real_write = chunk_writer.write_chunk
    real_publish = chunk_writer.publish_image

    def slow(real):
        def wrapped(*args, **kwargs):
            writes.append(1)
            time.sleep(0.3)
            return real(*args, **kwargs)

        return wrapped

    store_module.write_chunk = slow(real_write)  # type: ignore[assignment]
    from npukv_store.store.write import staging as saver

    saver.publish_image = slow(real_publish)  # type: ignore[assignment]
    config = StoreConfig(cache_dir=cache_dir, ring_size="8MiB", fsync="never")
    spec = tiny_spec()
    with KVStore(config, spec) as store:
        store.prepare_async()
        tensors = block_tensors(spec, keys)
        barrier.wait()
        if mode == "sync":
            result = store.put(keys, tensors)
        else:
            result = store.put_async(keys, tensors)
            assert store.flush(30)
        results.put((os.getpid(), len(writes), result.stored, result.queued))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_processes_saving_the_same_keys_write_one_chunk(tmp_path, mode):
    cache = str(tmp_path / "cache")
    keys = [i.to_bytes(16, "little") for i in range(1, 9)]
    barrier, results = CTX.Barrier(2), CTX.Queue()
    procs = [
        CTX.Process(target=_slow_saver, args=(cache, keys, mode, barrier, results))
        for _ in range(2)
    ]
    with reaping(*procs):
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(90)
            assert proc.exitcode == 0
        reports = [results.get(timeout=5) for _ in procs]
    assert sorted(r[1] for r in reports) == [0, 1], reports  # one chunk written
    with KVStore(StoreConfig(cache_dir=cache), tiny_spec()) as store:
        stats = store.stats()
        assert stats.num_chunks == 1
        assert stats.num_blocks == len(keys)
        assert stats.claims_held == 0  # both released
        assert store.check(verify_data=True) == []


def _claim_and_wait(cache_dir, keys, now_ns, ready, done):
    table = ClaimTable(os.path.join(cache_dir, "claims"))
    assert all(table.claim(keys, now_ns=now_ns))
    ready.set()
    done.wait(60)
    table.release(keys)
    table.close()


@contextlib.contextmanager
def _claimant(cache_dir, keys, now_ns=None):
    """A process that claims ``keys`` and holds them until ``done`` is set
    (or it is killed); yields (the process, done). On leaving, ``done`` is
    set and the process waited for (killed if it does not end), on every
    path."""
    ready, done = CTX.Event(), CTX.Event()
    proc = CTX.Process(
        target=_claim_and_wait, args=(cache_dir, keys, now_ns, ready, done)
    )
    try:
        proc.start()
        assert ready.wait(30), "the claimant did not claim within 30 s"
        yield proc, done
    finally:
        # Not after a kill: Event.set() waits for every sleeper of the event
        # to wake, and a process killed in done.wait() never does (it hung).
        if proc.is_alive():
            done.set()
            proc.join(30)
        reap(proc)


def test_a_live_claim_is_respected_then_released(tmp_path, spec, config):
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    with KVStore(config, spec) as store:  # creates the directory
        with _claimant(config.cache_dir, keys[:2]):
            result = store.put(keys, block_tensors(spec, keys))
            assert (result.stored, result.skipped) == (2, 2)
            assert store.lookup(keys) == 0  # the claimed two are not ours to write
            assert store.stats().claims_held == 2
        assert store.put(keys, block_tensors(spec, keys)).stored == 2
        assert store.lookup(keys) == 4
        assert store.stats().claims_held == 0


def test_the_claims_of_a_killed_process_are_taken_over(tmp_path, spec, config):
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    with KVStore(config, spec) as store:
        with _claimant(config.cache_dir, keys) as (proc, _):
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL
        assert store.stats().claims_held == 4  # left behind by the kill
        assert store.put(keys, block_tensors(spec, keys)).stored == 4
        assert store.lookup(keys) == 4
        assert store.stats().claims_held == 0


def test_an_expired_claim_of_a_live_process_is_taken_over(tmp_path, spec, config):
    keys = [bytes([i]) * 16 for i in range(1, 3)]
    with KVStore(config, spec) as store:
        old = time.time_ns() - int((CLAIM_TTL_S + 1) * 1e9)
        with _claimant(config.cache_dir, keys, now_ns=old):
            assert store.put(keys, block_tensors(spec, keys)).stored == 2


def test_sweep_removes_only_dead_and_expired_claims(tmp_path):
    table = ClaimTable(str(tmp_path / "claims"))
    live, expired = b"l" * 16, b"e" * 16
    assert table.claim([live])
    assert table.claim([expired], now_ns=1)
    assert table.held() == 2
    assert table.sweep() == 1
    assert table.held() == 1
    assert table.claim([live, live]) == [False, False]  # ours and live
    table.release([live])
    assert table.held() == 0
    table.close()


def test_a_garbled_claims_table_is_recreated(tmp_path):
    path = tmp_path / "claims"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"\xff" * 8192)
    table = ClaimTable(str(path))
    assert table.claim([b"k" * 16]) == [True]
    table.close()
