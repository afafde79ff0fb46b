"""The maintenance job (npukv_store/maintenance.py, scripts/compact.py): every step
alone, its summary, its exit codes and its lock."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench.harness.processes import reaping
from npukv_store import KVStore, StoreConfig
from npukv_store.maintenance import Options, run
from npukv_store.store.index_rows import ChunkRecord
from npukv_store.store.write.chunk_file import write_chunk
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
CTX = mp.get_context("spawn")


def _keys(n, salt=b""):
    return [secrets.token_bytes(16) for _ in range(n)]


def _reads_back(config, spec, keys):
    """How many of ``keys`` read back with exactly their bytes (a wrong byte
    fails the test: a miss is allowed only where the caller expects it)."""
    with KVStore(config, spec) as store:
        out = empty_blocks(spec, len(keys))
        ok = store.read(keys, out)
        expected = block_tensors(spec, keys)
        for name in out:
            for row, hit in enumerate(ok):
                if hit:
                    assert np.array_equal(out[name][row], expected[name][row]), name
        return sum(ok)


def _compact(cache_dir, *args, ring_dir):
    """scripts/compact.py as an operator runs it: (exit code, JSON summary)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "compact.py"), str(cache_dir),
         "--json", "--ring-dir", str(ring_dir), *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    summary = json.loads(done.stdout) if done.stdout.strip() else None
    return done.returncode, summary, done.stderr


@pytest.fixture
def rings(tmp_path):
    path = tmp_path / "shm"
    path.mkdir()
    return path


def test_decode_sized_chunks_are_merged_into_one(tmp_path, spec, config, rings):
    keys = _keys(30)
    with KVStore(config, spec) as store:
        for key in keys:  # one block per chunk, as save_decode makes them
            assert store.put([key], block_tensors(spec, [key])).stored == 1
    code, summary, err = _compact(config.cache_dir, ring_dir=rings)
    assert code == 0, err
    assert summary["chunks_before"] == 30
    assert summary["chunks_after"] == 1
    assert summary["rewritten"] == 30
    assert summary["bytes_after"] < summary["bytes_before"]  # 29 headers fewer
    documented = (
        "chunks_before", "chunks_after", "bytes_before", "bytes_after",
        "rewritten", "evicted", "orphans_removed", "quarantined", "seconds",
    )  # fmt: skip
    assert set(documented) <= set(summary)
    assert _reads_back(config, spec, keys) == 30
    with KVStore(config, spec) as store:
        assert store.check(verify_data=True) == []
        # the merged chunk keeps creation order: a prefix reads front to back
        (record,) = store.index.iter_chunks()
        assert list(record.keys) == keys


def _put_overlapping(store, spec, keys):
    """A chunk whose rows lost to rows already stored: what a writer whose
    claim expired leaves (first commit wins; the loser's rows are dead)."""
    chunk_id = secrets.randbits(63) + 1
    rows = {
        n: a.reshape(len(keys), -1).view(np.uint8)
        for n, a in block_tensors(spec, keys).items()
    }
    created = time.time_ns()
    path, size = write_chunk(
        store.dir, spec, store.namespace, chunk_id, keys, rows,
        created_ns=created, sync=False,
    )  # fmt: skip
    record = ChunkRecord.new(chunk_id, store.fingerprint, keys, size, created)
    return store.publisher.commit(record, path)


def test_chunks_with_dead_rows_are_rewritten_without_them(
    tmp_path, spec, config, rings
):
    big = StoreConfig(cache_dir=config.cache_dir, capacity="64MiB")
    keys = _keys(12)
    with KVStore(big, spec) as store:
        assert store.put(keys[:9], block_tensors(spec, keys[:9])).stored == 9
        assert _put_overlapping(store, spec, keys).stored == 3  # 9 dead rows
        used = store.stats().total_bytes
    code, summary, err = _compact(
        big.cache_dir, "--min-live", "0.5", "--chunk-size", "16KiB", ring_dir=rings
    )
    assert code == 0, err
    # The 12-row chunk (3 live) is rewritten; the 9-row chunk is full and
    # large against the 16 KiB target, so it stays.
    assert summary["rewritten"] == 1, summary
    assert summary["chunks_after"] == 2
    assert summary["bytes_after"] < used
    assert _reads_back(big, spec, keys) == 12
    with KVStore(big, spec) as store:
        assert store.check(verify_data=True) == []
        assert all(r.live_rows == r.num_rows for r in store.index.iter_chunks())


def test_eviction_down_to_a_target_fraction(tmp_path, spec, rings):
    cache = str(tmp_path / "cache")
    config = StoreConfig(cache_dir=cache, capacity="1MiB")
    keys = _keys(60)
    with KVStore(config, spec) as store:
        for i in range(0, 60, 4):
            store.put(keys[i : i + 4], block_tensors(spec, keys[i : i + 4]))
        used = store.stats().total_bytes
    assert used > 0.2 * (1 << 20)
    code, summary, err = _compact(
        cache, "--target", "0.1", "--grace", "0", "--min-live", "0", ring_dir=rings
    )
    assert code == 0, err
    assert summary["evicted"] > 0
    # capacity comes from the index: what the servers committed with
    assert summary["bytes_after"] <= 0.1 * (1 << 20)
    # oldest first: the newest blocks survive
    assert _reads_back(config, spec, keys[-4:]) == 4
    assert _reads_back(config, spec, keys[:4]) == 0


def test_target_without_a_recorded_capacity_is_one_clear_error(tmp_path, rings):
    cache = tmp_path / "cache"
    KVStore(StoreConfig(cache_dir=str(cache)), tiny_spec()).close()  # no commit
    code, summary, err = _compact(cache, "--target", "0.5", ring_dir=rings)
    assert code == 2
    assert summary is None
    assert "expected --capacity SIZE" in err
    assert len(err.strip().splitlines()) == 1


def _dead_pid():
    proc = CTX.Process(target=time.sleep, args=(0,))
    with reaping(proc):
        proc.start()
        proc.join(30)
    return proc.pid


def test_garbage_is_removed_and_reported_then_a_second_run_is_clean(
    tmp_path, spec, config, rings
):
    keys = _keys(8)
    with KVStore(config, spec) as store:
        store.put(keys[:4], block_tensors(spec, keys[:4]))
        store.put(keys[4:], block_tensors(spec, keys[4:]))
        doomed = next(iter(store.index.iter_chunks()))
        doomed_path = store.dir.chunk_path(store.namespace, doomed.chunk_id)
        ns_chunks = os.path.dirname(doomed_path)
    pid = _dead_pid()
    cache = Path(config.cache_dir)
    (cache / "tmp" / f"{pid}-00000000000000aa.tmp").write_bytes(b"x" * 100)
    # an orphan: a chunk file of a dead writer that never committed
    orphan = Path(ns_chunks) / "00000000000000bb.safetensors"
    with open(doomed_path, "rb") as src:
        data = src.read()
    orphan.write_bytes(data.replace(f"{os.getpid()}@".encode(), f"{pid}@".encode()))
    os.unlink(doomed_path)  # rows whose file is gone
    ring = rings / "npukv-ring-stale"
    header = b"NPUKVRNG" + (1).to_bytes(4, "little") + (4096).to_bytes(4, "little")
    header += (4096).to_bytes(8, "little") + pid.to_bytes(4, "little")
    ring.write_bytes(header.ljust(8192, b"\0"))
    code, summary, err = _compact(cache, "--dry-run", ring_dir=rings)
    assert code == 1, err
    assert (summary["tmp_removed"], summary["orphans_removed"]) == (1, 1)
    assert summary["missing_dropped"] == 1
    assert summary["rings_removed"] == 1
    assert orphan.exists()  # a dry run changes nothing
    assert ring.exists()
    code, summary, err = _compact(cache, ring_dir=rings)
    assert code == 1, err
    assert summary["orphans_removed"] == 1
    assert not orphan.exists()
    assert not ring.exists()
    assert os.listdir(cache / "tmp") == []
    code, summary, err = _compact(cache, ring_dir=rings)
    assert code == 0, (summary, err)
    lost = [k for k in keys if k not in doomed.keys]
    assert _reads_back(config, spec, lost) == 4
    with KVStore(config, spec) as store:
        assert store.check(verify_data=True) == []


def test_verify_quarantines_a_bad_chunk_and_keeps_the_evidence(
    tmp_path, spec, config, rings
):
    keys = _keys(8)
    with KVStore(config, spec) as store:
        store.put(keys[:4], block_tensors(spec, keys[:4]))
        store.put(keys[4:], block_tensors(spec, keys[4:]))
        bad = store.index.locate(keys[:1])[0][0]
        path = store.dir.chunk_path(store.namespace, bad)
    with open(path, "r+b") as handle:  # one bit of the last data byte
        handle.seek(os.path.getsize(path) - 8 * 4 * 3 - 1)
        byte = handle.read(1)[0]
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte ^ 1]))
    code, summary, _ = _compact(config.cache_dir, "--gc-only", ring_dir=rings)
    assert code == 0  # without --verify the data is not read: nothing found
    code, summary, err = _compact(config.cache_dir, "--verify", ring_dir=rings)
    assert code == 1, err
    assert summary["quarantined"] == 1
    assert f"{bad:016x}" in summary["quarantined_chunks"][0]
    quarantined = list((Path(config.cache_dir) / "quarantine").iterdir())
    assert [p.name for p in quarantined] == [
        f"{os.path.basename(os.path.dirname(os.path.dirname(path)))}-{bad:016x}"
        ".safetensors"
    ]
    assert _reads_back(config, spec, keys[:4]) == 0
    assert _reads_back(config, spec, keys[4:]) == 4
    code, summary, err = _compact(config.cache_dir, "--verify", ring_dir=rings)
    assert code == 0, (summary, err)


def test_compaction_quarantines_a_corrupt_chunk_it_meets(tmp_path, spec, config, rings):
    keys = _keys(8)
    with KVStore(config, spec) as store:
        store.put(keys[:4], block_tensors(spec, keys[:4]))
        store.put(keys[4:], block_tensors(spec, keys[4:]))
        path = store.dir.chunk_path(store.namespace, store.index.locate(keys[:1])[0][0])
    with open(path, "r+b") as handle:  # a bit in the first block's first layer
        handle.seek(4096)
        byte = handle.read(1)[0]
        handle.seek(4096)
        handle.write(bytes([byte ^ 0x10]))
    code, summary, err = _compact(config.cache_dir, ring_dir=rings)
    assert code == 1, err
    assert summary["quarantined"] == 1
    assert (
        summary["chunks_after"] == 1
    )  # the good rows rewritten; the bad in quarantine/
    assert _reads_back(config, spec, keys[:4]) == 0
    assert _reads_back(config, spec, keys[4:]) == 4


def _hold_lock(cache_dir, ready, done):
    from npukv_store.maintenance import maintenance_lock
    from npukv_store.store.directory import CacheDir

    with maintenance_lock(CacheDir(cache_dir)):
        ready.set()
        done.wait(60)


def test_one_run_at_a_time_and_a_killed_runs_lock_is_taken_over(
    tmp_path, spec, config, rings
):
    KVStore(config, spec).close()
    ready, done = CTX.Event(), CTX.Event()
    holder = CTX.Process(target=_hold_lock, args=(config.cache_dir, ready, done))
    with reaping(holder):
        holder.start()
        assert ready.wait(30)
        code, summary, err = _compact(config.cache_dir, ring_dir=rings)
        assert code == 2
        assert f"held by pid {holder.pid}" in err
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
    code, summary, err = _compact(config.cache_dir, ring_dir=rings)
    assert code == 0, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "1.5"], "expected a fraction 0..1"),
        (["--min-live", "x"], "expected a fraction 0..1"),
        (["--capacity", "lots"], "expected a non-negative size"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, rings, args, message):
    code, _, err = _compact(tmp_path, *args, ring_dir=rings)
    assert code == 2
    assert message in err


def test_a_directory_that_is_not_a_cache_exits_2(tmp_path, rings):
    for bad in (tmp_path / "missing", tmp_path):
        code, _, err = _compact(bad, ring_dir=rings)
        assert code == 2
        assert "marker" in err
        assert len(err.strip().splitlines()) == 1


def test_run_reports_progress_per_step(tmp_path, spec, config):
    with KVStore(config, spec) as store:
        for key in _keys(3):
            store.put([key], block_tensors(spec, [key]))
    steps = []
    summary = run(
        Options(cache_dir=config.cache_dir, verify=True, ring_dir=str(tmp_path)),
        lambda step, n: steps.append((step, n)),
    )
    assert ("verify", 3) in steps
    assert ("compact", 1) in steps
    assert summary.chunks_after == 1


def _rewrite(store, spec, keys, created_ns):
    """A compaction's new chunk of ``keys``, written but not yet published:
    (chunk id, path, size)."""
    rows = {
        n: arr.reshape(len(keys), -1).view(np.uint8)
        for n, arr in block_tensors(spec, keys).items()
    }
    new_id = secrets.randbits(63) + 1
    path, size = write_chunk(
        store.dir, spec, store.namespace, new_id, keys, rows,
        created_ns=created_ns, sync=False,
    )  # fmt: skip
    return new_id, path, size


def test_a_row_whose_home_moved_during_compaction_keeps_its_new_home(
    tmp_path, spec, config
):
    """Compaction read chunk A; before its commit A was evicted and a server
    stored one of A's keys again in chunk C. The commit must not take that key
    from C (C's live count would lie), and with no row won it changes nothing."""
    keys = _keys(4)
    with KVStore(config, spec) as store:
        store.put(keys, block_tensors(spec, keys))
        (old,) = store.index.iter_chunks()
        new_id, path, size = _rewrite(store, spec, keys, old.created_ns)
        store.index.remove_chunks([old.chunk_id])  # evicted, as a commit does
        os.unlink(store.dir.chunk_path(store.namespace, old.chunk_id))
        store.put(keys[:1], block_tensors(spec, keys[:1]))
        home = store.index.locate(keys[:1])[0]
        record = ChunkRecord.new(new_id, store.fingerprint, keys, size, old.created_ns)
        live, removed = store.publisher.replace(
            record, path, [(old.chunk_id, row) for row in range(4)], [old.chunk_id]
        )
        assert (live, removed) == (0, [])
        assert not os.path.exists(path)
        assert store.index.locate(keys[:1])[0] == home
        assert store.check(verify_data=True) == []


def test_a_rewrite_whose_sources_were_evicted_meanwhile_never_grows_the_ledger(
    tmp_path, spec, config
):
    """Compaction read chunks A and B; before its commit A was evicted. The
    rewrite still holds A's rows (dead now), so it is larger than B alone:
    publishing it would grow the ledger beyond what the commits allowed (a
    live run went past capacity that way). Nothing changes instead."""
    keys = _keys(8)
    with KVStore(config, spec) as store:
        store.put(keys[:4], block_tensors(spec, keys[:4]))
        store.put(keys[4:], block_tensors(spec, keys[4:]))
        a, b = sorted(store.index.iter_chunks(), key=lambda c: c.keys[0] != keys[0])
        total = store.stats().total_bytes
        new_id, path, size = _rewrite(store, spec, keys, a.created_ns)
        assert size > b.size_bytes
        store.index.remove_chunks([a.chunk_id])  # evicted, as a commit does
        os.unlink(store.dir.chunk_path(store.namespace, a.chunk_id))
        record = ChunkRecord.new(new_id, store.fingerprint, keys, size, a.created_ns)
        sources = [(a.chunk_id, r) for r in range(4)] + [
            (b.chunk_id, r) for r in range(4)
        ]
        live, removed = store.publisher.replace(
            record, path, sources, [a.chunk_id, b.chunk_id]
        )
        assert (live, removed) == (0, [])
        assert not os.path.exists(path)
        assert store.stats().total_bytes == total - a.size_bytes
        assert store.lookup(keys[4:]) == 4  # B is as it was
        assert store.check(verify_data=True) == []


def test_rebuild_index_restores_what_the_index_lost(tmp_path, spec, config, rings):
    keys = _keys(12)
    with KVStore(config, spec) as store:
        for i in range(0, 12, 3):
            store.put(keys[i : i + 3], block_tensors(spec, keys[i : i + 3]))
        # the index forgets one chunk whose file stays (a stale index)
        chunk_id = store.index.locate(keys[:1])[0][0]
        store.index.remove_chunks([chunk_id])
        store.index.forget_dead([chunk_id])
    code, summary, err = _compact(config.cache_dir, "--gc-only", ring_dir=rings)
    assert code == 0, err  # its writer (this process) lives: not an orphan yet
    assert summary["chunks_before"] == 3
    code, summary, err = _compact(config.cache_dir, "--rebuild-index", ring_dir=rings)
    assert code == 0, err
    assert summary["chunks_before"] == 4  # rebuilt from the chunk files
    assert summary["chunks_after"] == 1  # then merged
    assert _reads_back(config, spec, keys) == 12
