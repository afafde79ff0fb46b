"""Saving under failing writes and missing space: a real full tmpfs, ENOSPC
from fsync and rename, failing or short engine writes, a stalling disk behind
a small ring, a ring that does not fit /dev/shm, stale rings, a full index,
tmp/ removed. Saving stops and is counted, never raises into the save path or
waits; it resumes when the fault goes; nothing stored before is lost.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import threading
import time

import pytest

from npukv_store import ConfigError, KVStore
from npukv_store.io import ring as ring_mod
from npukv_store.testing import faults as io_faults
from tests.support import faults
from tests.support.blocks import block_tensors, tiny_spec
from tests.support.chunks import tmp_files
from tests.support.faults import (
    BIG,
    BLOCKS,
    SMALL,
    WriteGate,
    config,
    fill,
    keys_for,
)
from tests.support.scenarios.oracles import SPEC


def _set_faults(monkeypatch: pytest.MonkeyPatch, spec: str | None) -> None:
    if spec is None:
        monkeypatch.delenv(io_faults.ENV, raising=False)
    else:
        monkeypatch.setenv(io_faults.ENV, spec)
    io_faults.forget_env_faults()


def _gate(monkeypatch: pytest.MonkeyPatch, rules: str = "") -> WriteGate:
    """NPUKV_FAULTS set to ``rules`` and a rule that lets a WriteGate hold
    every other write (the gate starts open)."""
    gate = WriteGate(monkeypatch)
    _set_faults(monkeypatch, ";".join(filter(None, (rules, GATED))))
    return gate


#: a rule that fires on every write and delays it 0 ms: what WriteGate holds
GATED = "write:slow:ms=0"


def _save(store: KVStore, keys: list[bytes], gate: WriteGate | None = None) -> None:
    """put_async + flush. With ``gate``, put_async runs with the disk's writes
    held: it must return without waiting for any (none held on its own
    thread, none waited out to the gate's deadline)."""
    if gate is not None:
        gate.shut()
    try:
        store.put_async(keys, block_tensors(store.spec, keys))
    finally:
        if gate is not None:
            gate.open()
    if gate is not None:
        assert gate.expired == 0, "put_async waited for a write to the disk"
        mine = threading.current_thread().name
        assert mine not in gate.threads, "put_async wrote on its own thread"
    assert store.flush(timeout_s=60)


def _no_leftovers(cache_dir: str) -> None:
    assert tmp_files(cache_dir) == [], "a failed save left a tmp file"


# -- a real full filesystem -------------------------------------------------------


def _full_tmpfs_trials(fault, tmp_path, gate: WriteGate | None) -> None:
    """Fill a real tmpfs, save into it, free it, save again; every trial runs
    to its end, and what broke the contract (put raising something else than
    OSError(ENOSPC), put_async raising at all or waiting for a write) is
    asserted at the end. ``gate``: put_async's (else put's) trials."""
    broken: list[str] = []
    asynchronous = gate is not None

    def save(keys: list[bytes]) -> None:
        try:
            if asynchronous:
                _save(store, keys, gate)
            else:
                store.put(keys, block_tensors(BIG, keys))
        except OSError as exc:
            if asynchronous or exc.errno != errno.ENOSPC:
                broken.append(f"{'put_async' if asynchronous else 'put'}: {exc!r}")
        except Exception as exc:  # noqa: BLE001 - the contract says which
            broken.append(f"{'put_async' if asynchronous else 'put'}: {exc!r}")

    with faults.tmpfs(tmp_path / "fs", "8m") as mount:
        for trial in fault.trials(2, 6):
            cfg = config(os.path.join(mount, "cache"))
            slack = [0, 100_000, 8192, 300_000, 40_000, 200_000][trial % 6]
            with KVStore(cfg, BIG) as store:
                durable = [k for _, ks in fill(store, f"full{trial}", chunks=2)
                           for k in ks]  # fmt: skip
                filler = faults.fill_disk(mount, leave=slack)
                missed = 0
                for attempt in range(4):
                    keys = keys_for(f"full{trial}:{attempt}", BLOCKS)
                    save(keys)
                    if store.lookup(keys) == len(keys):
                        durable += keys  # it fit after all: durable too
                    else:
                        missed += 1
                assert missed > 0, "the disk never filled up"
                counters = store.stats().counters
                if asynchronous and not broken:  # a miss is a counted failure
                    assert counters["failed_batches"] + counters["dropped_blocks"]
                _no_leftovers(cfg.cache_dir)
                fault.durable(store, durable, f"trial {trial} (disk full):")
                os.unlink(filler)  # space comes back
                keys = keys_for(f"full{trial}:after", BLOCKS)
                save(keys)
                assert store.lookup(keys) == len(keys), "saving did not resume"
                assert store.check() == []
            with KVStore(cfg, BIG) as store:
                fault.durable(store, durable + keys, f"trial {trial} (reopened):")
            shutil.rmtree(cfg.cache_dir)
    assert not broken, f"{len(broken)} saves broke the contract: {broken[:3]}"


#: Where the disk fills first decides: the save claims' LMDB (store/claims.py)
#: raises lmdb.DiskError out of put()/put_async() when its commit finds no
#: space; the chunk write raises OSError (put) or is counted (put_async).
@pytest.mark.fault("enospc-tmpfs-put")
def test_full_disk_sync_put(fault, tmp_path):
    _full_tmpfs_trials(fault, tmp_path, None)


@pytest.mark.fault("enospc-tmpfs-save")
def test_full_disk_async_save(fault, tmp_path, monkeypatch):
    _full_tmpfs_trials(fault, tmp_path, _gate(monkeypatch))


# -- ENOSPC from fsync and rename (in this process) -------------------------------


def _is_tmp_chunk(path: str) -> bool:
    return f"{os.sep}tmp{os.sep}" in path and path.endswith(".tmp")


def _syscall_fault_trials(fault, tmp_path, monkeypatch, name: str) -> None:
    real = getattr(os, name)
    injected = [0]
    budget = [0]

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if budget[0] > 0 and _is_tmp_chunk(path):
            budget[0] -= 1
            injected[0] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    def rename(src, dst, *args, **kwargs):
        # the store renames relative to a directory fd: where src really is
        where = kwargs.get("src_dir_fd")
        if where is not None:
            src = os.path.join(os.readlink(f"/proc/self/fd/{where}"), src)
        if budget[0] > 0 and _is_tmp_chunk(str(src)):
            budget[0] -= 1
            injected[0] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, name, fsync if name == "fsync" else rename)
    cfg = config(tmp_path / "cache")
    with KVStore(cfg, BIG) as store:
        durable = [k for _, ks in fill(store, "sys", chunks=2) for k in ks]
        for trial in fault.trials(2, 8):
            budget[0] = 1 + trial % 2
            keys = keys_for(f"sys{trial}", BLOCKS)
            before = injected[0]
            if trial % 2:  # the save path: counted in the writer, never raised
                failed_before = store.stats().counters["failed_batches"]
                _save(store, keys)
                assert store.stats().counters["failed_batches"] > failed_before
            else:
                with pytest.raises(OSError, match="No space left"):
                    store.put(keys, block_tensors(BIG, keys))
            assert injected[0] > before, f"the store no longer calls os.{name}"
            assert store.lookup(keys) == 0, "a failed save was published"
            _no_leftovers(cfg.cache_dir)
            budget[0] = 0
            _save(store, keys)  # saving goes on
            assert store.lookup(keys) == len(keys)
            durable += keys
            fault.durable(store, durable, f"trial {trial}:")
        assert store.check(verify_data=True) == []


@pytest.mark.fault("enospc-fsync")
def test_enospc_on_fsync(fault, tmp_path, monkeypatch):
    _syscall_fault_trials(fault, tmp_path, monkeypatch, "fsync")


@pytest.mark.fault("enospc-rename")
def test_enospc_on_rename(fault, tmp_path, monkeypatch):
    _syscall_fault_trials(fault, tmp_path, monkeypatch, "rename")


# -- the writer's engine ----------------------------------------------------------


def _engine_write_trials(fault, tmp_path, monkeypatch, kind: str) -> None:
    cfg = config(tmp_path / "cache")
    with KVStore(cfg, BIG) as store:
        durable = [k for _, ks in fill(store, kind, chunks=2) for k in ks]
    gate = WriteGate(monkeypatch)
    for trial in fault.trials(2, 6):
        failing = 1 + trial % 3
        _set_faults(monkeypatch, f"write:{kind}:count={failing};{GATED}")
        with KVStore(cfg, BIG) as store:  # a fresh writer, wrapped
            batches = [keys_for(f"{kind}{trial}:{b}", BLOCKS) for b in range(4)]
            for keys in batches:
                _save(store, keys, gate)  # put_async waits for no write
            counters = store.stats().counters
            stored = [keys for keys in batches if store.lookup(keys) == len(keys)]
        rule = io_faults.faults_from_env()[0]
        assert rule.injected == failing, "the fault did not fire as asked"
        assert 0 < counters["failed_batches"] <= failing
        assert len(stored) >= len(batches) - failing, "saving did not resume"
        _set_faults(monkeypatch, None)
        _no_leftovers(cfg.cache_dir)
        durable += [k for keys in stored for k in keys]
        with KVStore(cfg, BIG) as store:
            fault.durable(store, durable, f"trial {trial}:")
            assert store.check(verify_data=True) == []


@pytest.mark.fault("enospc-engine-write")
def test_engine_write_enospc(fault, tmp_path, monkeypatch):
    _engine_write_trials(fault, tmp_path, monkeypatch, "enospc")


@pytest.mark.fault("short-write")
def test_engine_short_write(fault, tmp_path, monkeypatch):
    _engine_write_trials(fault, tmp_path, monkeypatch, "short")


@pytest.mark.fault("slow-disk-ring-full")
def test_a_stalling_disk_drops_saves_instead_of_waiting(fault, tmp_path, monkeypatch):
    """The disk stalls (its writes held until the test opens the gate, with a
    deadline to fail by): every put_async returns while the writer is still
    held in a write; the small ring fills and the later batches are dropped
    and counted, not waited for."""
    gate = WriteGate(monkeypatch)
    for trial in fault.trials(1, 4):
        _set_faults(monkeypatch, GATED)
        cfg = config(tmp_path / f"t{trial}", ring_size="1MiB")  # two batches
        with KVStore(cfg, BIG) as store:
            store.prepare_async()
            batches = [keys_for(f"slow{trial}:{b}", BLOCKS) for b in range(8)]
            results = []
            gate.shut()
            try:
                for keys in batches:
                    results.append(store.put_async(keys, block_tensors(BIG, keys)))
                    if len(results) == 1:  # the writer takes the first batch
                        _until(lambda: gate.held > 0, "the writer never wrote")
                    assert gate.held, "put_async returned once the disk did"
            finally:
                gate.open()
            assert gate.expired == 0, "put_async waited for a write"
            assert threading.current_thread().name not in gate.threads
            assert store.flush(timeout_s=60)
            counters = store.stats().counters
            queued = [k for k, r in zip(batches, results, strict=True) if r.queued]
            dropped = [k for k, r in zip(batches, results, strict=True) if r.dropped]
            fault.durable(store, [k for keys in queued for k in keys])
            assert dropped, "the ring never filled"
            assert counters["dropped_blocks"] == BLOCKS * len(dropped)
            assert all(store.lookup(keys) == 0 for keys in dropped)
            _set_faults(monkeypatch, None)


def _until(predicate, what: str, deadline_s: float = 20.0) -> None:
    """Poll ``predicate`` until it holds; ``deadline_s`` is one to fail by."""
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, what
        time.sleep(0.005)


# -- the staging ring -------------------------------------------------------------


def _too_large() -> int:
    return shutil.disk_usage("/dev/shm").total + (1 << 30)


def _rings() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(ring_mod.NAME_PREFIX)}


@pytest.mark.fault("ring-larger-than-shm")
def test_ring_larger_than_dev_shm(fault, tmp_path):
    size = _too_large()
    for trial in fault.trials(1, 3):
        before = _rings()
        cfg = config(tmp_path / "cache", ring_size=size)
        with KVStore(cfg, SMALL) as store:
            with pytest.raises(ConfigError) as caught:
                store.prepare_async()
            message = str(caught.value)
            assert "ring_size" in message, message
            assert "/dev/shm" in message, message
            assert str(-(-size // 4096) * 4096) in message, message
            keys = keys_for(f"ring{trial}", 4)
            tensors = block_tensors(SMALL, keys)
            with pytest.raises(ConfigError, match="ring_size"):
                store.put_async(keys, tensors)
            assert store.put(keys, tensors).stored == 4  # the keys stayed savable
            fault.durable(store, keys)
        assert _rings() <= before, "a failed ring left its file in /dev/shm"


def _fake_ring(path: str, pid: int, body: bytes | None = None) -> None:
    with open(path, "wb") as handle:
        if body is None:
            header = struct.pack("<8sIIQI", ring_mod.RING_MAGIC, ring_mod.RING_FORMAT,
                                 ring_mod.HEADER_BYTES, 4096, pid)  # fmt: skip
            handle.write(header.ljust(ring_mod.HEADER_BYTES + 4096, b"\0"))
        else:
            handle.write(body)


def _dead_pid() -> int:
    child = faults.run_child("import os; print(os.getpid())")
    return int(child.stdout)


@pytest.mark.fault("stale-ring-dead-pid")
def test_stale_ring_of_a_dead_pid_is_removed(fault, tmp_path):
    for trial in fault.trials(1, 3):
        dead = os.path.join("/dev/shm", f"{ring_mod.NAME_PREFIX}{trial}-deadbeef")
        live = os.path.join("/dev/shm", f"{ring_mod.NAME_PREFIX}{trial}-live0001")
        _fake_ring(dead, _dead_pid())
        _fake_ring(live, os.getppid() if os.getppid() > 1 else os.getpid())
        try:
            with KVStore(config(tmp_path / "cache"), SMALL) as store:
                store.prepare_async()
                keys = keys_for(f"stale{trial}", 4)
                _save(store, keys)
                fault.durable(store, keys)
            assert not os.path.exists(dead), "the dead pid's ring was kept"
            assert os.path.exists(live), "a live process's ring was removed"
        finally:
            for path in (dead, live):
                if os.path.exists(path):
                    os.unlink(path)


@pytest.mark.fault("foreign-ring-file")
def test_garbage_named_like_a_ring_is_left_alone(fault, tmp_path):
    for trial in fault.trials(1, 3):
        path = os.path.join("/dev/shm", f"{ring_mod.NAME_PREFIX}garbage{trial}")
        body = [b"", b"not a ring", os.urandom(5000)][trial % 3]
        _fake_ring(path, 0, body)
        try:
            with KVStore(config(tmp_path / "cache"), SMALL) as store:
                keys = keys_for(f"foreign{trial}", 4)
                _save(store, keys)
                fault.durable(store, keys)
            with open(path, "rb") as handle:
                assert handle.read() == body, "a file not ours was changed"
        finally:
            os.unlink(path)


@pytest.mark.fault("ring-larger-than-shm-connector")
def test_connector_worker_turns_off_when_the_ring_does_not_fit(fault, tmp_path, caplog):
    pytest.importorskip("torch")
    pytest.importorskip("vllm", reason="the connector needs vLLM")
    from npukv_store.connector.metadata import NPUKVMetadata
    from npukv_store.connector.worker.side import WorkerSide
    from tests.support.connector import cpu_caches, engine_config, transfer

    for trial in fault.trials(1, 2):
        cfg = config(tmp_path / f"c{trial}", ring_size=_too_large())
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="npukv_store"):
            worker = WorkerSide(*engine_config(), cfg)
            worker.register(cpu_caches(seed=trial))
            keys = keys_for(f"conn{trial}", 2)
            worker.bind(NPUKVMetadata(loads=[transfer(keys, [3, 4])],
                                      saves=[transfer(keys, [5, 6])]))  # fmt: skip
            worker.start_load()
            worker.finish_step()
            errors = worker.take_load_errors()
            worker.close()
        lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert "ring_size" in worker.disabled_reason
        assert len(lines) == 1, lines
        assert "ring_size" in lines[0].getMessage(), lines
        if lines[0].exc_info or "Traceback" in caplog.text:
            fault.crashed(f"a traceback where one line was expected: {caplog.text}")
        assert errors == {3, 4}, "a planned load was not reported failed"


# -- the index and tmp/ -----------------------------------------------------------


@pytest.mark.fault("index-map-full")
def test_full_index_fails_saves_and_counts_them(fault, tmp_path):
    spec = tiny_spec(block_size=SPEC.block_size, row_shape=(4, 2, 8))  # many keys
    for trial in fault.trials(1, 2):
        cfg = config(tmp_path / f"t{trial}", index_map_size="1MiB", ring_size="8MiB")
        durable: list[bytes] = []
        with KVStore(cfg, spec) as store:
            for batch in range(1000):
                keys = keys_for(f"map{trial}:{batch}", 256)
                store.put_async(keys, block_tensors(spec, keys))
                if batch % 5 == 4:
                    assert store.flush(timeout_s=60)
                    if store.stats().counters["failed_batches"]:
                        break
                    durable = keys
            assert store.flush(timeout_s=60)
            assert store.stats().counters["failed_batches"] > 0, "never filled"
            fault.durable(store, durable, f"trial {trial}:")
            _no_leftovers(cfg.cache_dir)
        shutil.rmtree(cfg.cache_dir)


@pytest.mark.fault("tmp-dir-removed")
def test_tmp_dir_removed_under_a_running_handle(fault, tmp_path, monkeypatch):
    gate = _gate(monkeypatch)
    for trial in fault.trials(1, 3):
        cfg = config(tmp_path / f"t{trial}")
        with KVStore(cfg, BIG) as store:
            durable = [k for _, ks in fill(store, f"tmp{trial}", chunks=2) for k in ks]
            shutil.rmtree(os.path.join(cfg.cache_dir, "tmp"))
            keys = keys_for(f"tmp{trial}:lost", BLOCKS)
            _save(store, keys, gate)  # put_async waits for no write
            counters = store.stats().counters
            if store.lookup(keys) != len(keys):
                assert counters["failed_batches"] > 0, "a failed save not counted"
            fault.durable(store, durable, f"trial {trial}:")
        with KVStore(cfg, BIG) as store:  # a re-open saves again
            again = keys_for(f"tmp{trial}:again", BLOCKS)
            _save(store, again)
            fault.durable(store, durable + again, f"trial {trial} reopened:")
