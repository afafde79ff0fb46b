"""The open path at scale: sessions decide whether an open scans, and a rebuild
commits in batches while other processes open and serve
(docs/decisions/0059).

* A clean close leaves no session record, so the next open does not scan:
  leftovers planted after it stay until ``npukv gc``, which removes them.
* A process that dies with the store open (its byte of ``.lock`` released by
  the kernel) is found by the next open, which scans once and forgets it.
* The first open after a reboot scans once, whatever ``sessions`` kept (a
  power cut may have taken its records: docs/decisions/0072); an opener
  that finds another one recording the boot leaves the scan to it.
* Session liveness is the byte lock, not the pid: a live holder is alive, a
  record in a slot nobody holds (or of a format we never write) is dead,
  and so is one written into a slot between our read and our lock.
* A rebuild paused between batches (a live child) does not keep another
  process from opening: that open, with a 2 s lock bound, serves the batch
  already committed and leaves the rebuild to its owner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.maintenance import Options, run
from npukv_store.store import recovery, sessions
from npukv_store.store.directory import HOST, CacheDir
from npukv_store.store.format import build_chunk
from npukv_store.store.index import Index
from npukv_store.store.locks import BOOT_BYTE, lock_byte, open_lock_file
from npukv_store.store.sessions import (
    SESSIONS_FILE,
    SLOT_BYTES,
    begin_session,
    dead_sessions,
)
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec, verify_read
from tests.support.chunks import chunk_files

pytestmark = pytest.mark.integration

OPEN_AND_HOLD = """
import sys, time
from npukv_store import KVStore, StoreConfig
from tests.support.blocks import tiny_spec
store = KVStore(StoreConfig(cache_dir=sys.argv[1]), tiny_spec())
print("open", flush=True)
time.sleep(600)
"""


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
PUT_AND_EXIT = """
import sys
from npukv_store import KVStore, StoreConfig
from tests.support.blocks import block_tensors, tiny_spec
with KVStore(StoreConfig(cache_dir=sys.argv[1]), tiny_spec()) as store:
    for tag in range(12):
        keys = store.keys_for(range(tag * 1000, tag * 1000 + 64))
        store.put(keys, block_tensors(store.spec, keys))
"""


def _keys(store: KVStore, tag: int) -> list[bytes]:
    return store.keys_for(range(tag * 1000, tag * 1000 + 64))


def _put(store: KVStore, tag: int) -> list[bytes]:
    keys = _keys(store, tag)
    store.put(keys, block_tensors(store.spec, keys))
    return keys


def _plant_leftovers(root: str, namespace: str, spec) -> tuple[str, str]:
    """A dead writer's tmp file and renamed-but-uncommitted chunk."""
    dead = int(
        subprocess.check_output([sys.executable, "-c", "import os; print(os.getpid())"])
    )
    tmp = os.path.join(root, "tmp", f"{dead}-00aa.tmp")
    with open(tmp, "wb") as handle:
        handle.write(b"half a chunk")
    keys = [bytes([i]) * 16 for i in range(4)]
    rows = {n: a.data.cast("B") for n, a in block_tensors(spec, keys).items()}
    buffers = build_chunk(
        spec, namespace, keys, rows, creator=f"{dead}@{HOST}", created_ns=1
    )
    orphan = os.path.join(root, namespace, "chunks", "00000000000000aa.safetensors")
    with open(orphan, "wb") as handle:
        handle.write(b"".join(bytes(b) for b in buffers))
    return tmp, orphan


def _hold_open(root: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", OPEN_AND_HOLD, root], stdout=subprocess.PIPE, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )  # fmt: skip
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "open"
    return child


def _kill(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.stdout is not None
    child.stdout.close()


def test_clean_close_means_no_scan_and_gc_removes_leftovers(tmp_path):
    spec = tiny_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, spec) as store:
        _put(store, 1)
        assert store._session.dead == {}  # a new directory: nobody died
    tmp, orphan = _plant_leftovers(config.cache_dir, store.namespace, spec)
    with KVStore(config, spec) as store:
        # Nobody died with the store open: the open scanned nothing.
        assert store._session.dead == {}
        assert os.path.exists(tmp)
        assert os.path.exists(orphan)
    summary = run(
        Options(cache_dir=config.cache_dir, gc_only=True, ring_dir=str(tmp_path))
    )
    assert (summary.tmp_removed, summary.orphans_removed) == (1, 1)
    assert not os.path.exists(tmp)
    assert not os.path.exists(orphan)


def test_a_process_killed_with_the_store_open_makes_the_next_open_scan(tmp_path):
    spec = tiny_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, spec) as store:
        keys = _put(store, 1)
    child = _hold_open(config.cache_dir)
    tmp, orphan = _plant_leftovers(config.cache_dir, store.namespace, spec)
    with KVStore(config, spec) as store:
        assert store._session.dead == {}  # the child lives: its byte is held
        assert os.path.exists(orphan)
    _kill(child)
    with KVStore(config, spec) as store:
        (record,) = store._session.dead.values()
        assert record.startswith(f"{child.pid}@".encode())
        assert not os.path.exists(tmp)
        assert not os.path.exists(orphan)
        out = empty_blocks(spec, len(keys))
        assert verify_read(spec, keys, out, store.read(keys, out)) == []
        assert store.check(verify_data=True) == []
    with KVStore(config, spec) as store:
        assert store._session.dead == {}  # scanned once, then forgotten


def test_the_first_open_after_a_reboot_scans_once(tmp_path, monkeypatch):
    spec = tiny_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, spec) as store:
        keys = _put(store, 1)
    # a clean close, then leftovers whose session record a power cut took
    tmp, orphan = _plant_leftovers(config.cache_dir, store.namespace, spec)
    with KVStore(config, spec) as store:
        assert not store._session.must_scan  # the same boot: no scan
        assert os.path.exists(orphan)
    monkeypatch.setattr(sessions, "boot_id", lambda: b"a-boot-after-a-power-cut")
    with KVStore(config, spec) as store:
        assert (store._session.dead, store._session.new_boot) == ({}, True)
        assert not os.path.exists(tmp)
        assert not os.path.exists(orphan)
        out = empty_blocks(spec, len(keys))
        assert verify_read(spec, keys, out, store.read(keys, out)) == []
        assert store.check(verify_data=True) == []
    with KVStore(config, spec) as store:
        assert not store._session.must_scan  # that boot is recorded: once


def test_an_opener_racing_the_boot_record_leaves_the_scan_to_its_holder(
    tmp_path, monkeypatch
):
    cdir = CacheDir(str(tmp_path / "c"))
    cdir.open()
    monkeypatch.setattr(sessions, "boot_id", lambda: b"boot-2")
    holder = open_lock_file(cdir, ".lock")
    try:
        assert lock_byte(holder, BOOT_BYTE)  # another opener is recording it
        racing = begin_session(cdir)
        assert not racing.new_boot
        racing.end()
    finally:
        os.close(holder)  # it died without recording: the next open does
    first = begin_session(cdir)
    second = begin_session(cdir)
    try:
        assert (first.new_boot, second.new_boot) == (True, False)
    finally:
        first.end()
        second.end()
    monkeypatch.setattr(sessions, "boot_id", lambda: None)  # no /proc: no check
    nowhere = begin_session(cdir)
    assert not nowhere.new_boot
    nowhere.end()


def test_gc_forgets_dead_sessions(tmp_path):
    spec = tiny_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    KVStore(config, spec).close()
    child = _hold_open(config.cache_dir)
    _kill(child)
    cdir = CacheDir.for_config(config)
    cdir.open()
    assert len(dead_sessions(cdir)) == 1
    run(Options(cache_dir=config.cache_dir, gc_only=True, ring_dir=str(tmp_path)))
    assert dead_sessions(cdir) == {}


def _write_slot(cdir: CacheDir, slot: int, raw: bytes) -> None:
    fd = cdir.open_file(SESSIONS_FILE, os.O_WRONLY)
    try:
        os.pwrite(fd, raw.ljust(SLOT_BYTES, b"\0"), slot * SLOT_BYTES)
    finally:
        os.close(fd)


def test_session_slots_are_distinct_and_liveness_is_the_byte(tmp_path):
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    KVStore(config, tiny_spec()).close()
    cdir = CacheDir.for_config(config)
    cdir.open()
    opened = [begin_session(cdir) for _ in range(5)]
    assert sorted(s.slot for s in opened) == [0, 1, 2, 3, 4]
    assert dead_sessions(cdir) == {}
    # A record in a slot nobody holds, and one of a shape never written:
    _write_slot(cdir, 900, b"S1@h 0")
    _write_slot(cdir, 7, b"junk")
    opened[2].lock_fd, fd = os.dup(opened[2].lock_fd), opened[2].lock_fd
    os.close(fd)  # the dup keeps the description: still alive
    another = begin_session(cdir)
    assert another.dead == {900: b"1@h 0", 7: b"junk"}
    assert another.slot == 5  # the lowest slot with no record and a free byte
    assert dead_sessions(cdir) == {}  # forgotten once found
    for session in [*opened, another]:
        session.end()
    with open(cdir.full(SESSIONS_FILE), "rb") as handle:
        assert set(handle.read()) == {0}  # every record cleared


def test_a_session_that_died_in_a_slot_just_read_as_free_is_dead(tmp_path, monkeypatch):
    """A slot free when the file was read, written by a process that then
    died before this open locked its byte: found dead, not taken."""
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    KVStore(config, tiny_spec()).close()
    cdir = CacheDir.for_config(config)
    cdir.open()
    real = sessions._read_records

    def read_then_race(fd: int) -> dict[int, bytes]:
        found = real(fd)
        _write_slot(cdir, 0, b"S4@h 1")  # slot 0 taken and its taker dead
        return found

    monkeypatch.setattr(sessions, "_read_records", read_then_race)
    session = begin_session(cdir)
    try:
        assert session.slot == 1
        assert session.dead == {0: b"4@h 1"}
        assert dead_sessions(cdir) == {}
    finally:
        session.end()


REBUILD_PAUSED = """
import os, sys, time
from npukv_store.store import recovery, sessions
from npukv_store.store.directory import CacheDir
from npukv_store.store.index import Index
from npukv_store.store.locks import BOOT_BYTE, lock_byte, open_lock_file
recovery.REBUILD_BATCH = int(sys.argv[2])
real = Index.commit_rebuilt
calls = [0]
def paused(self, records):
    done = real(self, records)
    calls[0] += 1
    if calls[0] == 1:
        print("one batch", flush=True)
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.01)
    return done
Index.commit_rebuilt = paused
cdir = CacheDir(sys.argv[1])
cdir.open()
recovery.rebuild_index(cdir, map_size=1 << 30, sync=True).close()
print("rebuilt", flush=True)
"""


def test_a_rebuild_between_batches_does_not_block_an_open(tmp_path):
    spec = tiny_spec()
    root = str(tmp_path / "c")
    config = StoreConfig(cache_dir=root, lock_timeout_s=2.0)
    # Written by a process that has exited: a chunk the rebuild has not
    # reached yet then looks like a dead writer's orphan to a scan.
    subprocess.run(
        [sys.executable, "-c", PUT_AND_EXIT, root], check=True, cwd=_REPO
    )  # fmt: skip
    with KVStore(config, spec) as store:
        chains = [_keys(store, tag) for tag in range(12)]
    go = str(tmp_path / "go")
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(REBUILD_PAUSED), root, "8", go],
        stdout=subprocess.PIPE, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "one batch"
        # The rebuild's owner lives and holds its byte: this open (lock bound
        # 2 s) neither waits for it nor takes it over, and serves what is in.
        with KVStore(config, spec) as store:
            served = [k for keys in chains for k in keys if store.lookup([k]) == 1]
            assert 0 < len(served) < sum(map(len, chains))
            out = empty_blocks(spec, len(served))
            assert verify_read(spec, served, out, store.read(served, out)) == []
            assert recovery.REBUILD_MARK in store.index.meta_records(
                recovery.REBUILD_MARK
            )
        # A gc beside the live rebuild: the chunks it has not reached are
        # unpublished, their creator dead, yet none is an orphan.
        files = set(chunk_files(root).values())
        run(Options(cache_dir=root, gc_only=True, ring_dir=str(tmp_path)))
        assert set(chunk_files(root).values()) == files
        assert child.poll() is None
    finally:
        open(go, "w").close()
        child.wait(timeout=120)
        assert child.stdout is not None
        child.stdout.close()
    assert child.returncode == 0
    with KVStore(config, spec) as store:
        for keys in chains:
            assert store.lookup(keys) == len(keys)
        assert store.index.meta_records(recovery.REBUILD_MARK) == {}
        assert store.check(verify_data=True) == []


def test_open_index_never_creates_an_index_beside_chunk_files(tmp_path):
    """An index that vanished is rebuilt, never opened empty (an empty one
    would make every chunk file an orphan)."""
    spec = tiny_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, spec) as store:
        keys = _put(store, 3)
    os.rename(os.path.join(config.cache_dir, "index"), str(tmp_path / "gone"))
    with KVStore(config, spec) as store:
        assert store.lookup(keys) == len(keys)
        assert store.index.meta_records(recovery.REBUILD_MARK) == {}
    index = Index(os.path.join(config.cache_dir, "index"), map_size=1 << 30, sync=False)
    try:
        assert len(list(index.iter_chunks())) >= 1
    finally:
        index.close()
