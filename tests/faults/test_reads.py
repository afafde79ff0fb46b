"""Faults on the read path: I/O errors, short reads, files vanishing or
shrinking under a reader. Any of it is a miss, never wrong bytes.

Reads with the page cache dropped go through the I/O engine, where
``NPUKV_FAULTS`` acts; layers wholly in the page cache are read by the native
``pread_layers_xxh3`` on the verifier threads, whose faults are injected there.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from npukv_store import KVStore, native
from npukv_store.testing import faults as io_faults
from tests.support import faults
from tests.support.blocks import block_tensors
from tests.support.faults import BIG, config, drop_page_cache, fill


def _record_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays the fault engine's slow rules hold requests for, recorded
    as they are slept (what the read waited for, not how long it took)."""
    slept: list[float] = []

    class _Time:
        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            slept.append(seconds)
            time.sleep(seconds)

    monkeypatch.setattr(io_faults, "time", _Time())
    return slept


def _set_faults(monkeypatch: pytest.MonkeyPatch, spec: str | None) -> None:
    if spec is None:
        monkeypatch.delenv(io_faults.ENV, raising=False)
    else:
        monkeypatch.setenv(io_faults.ENV, spec)
    io_faults.forget_env_faults()


def _restore(store: KVStore, chunks: list[tuple[str, list[bytes]]]) -> list:
    """Put back the chunks a trial quarantined; the current ``[(path, keys)]``."""
    out = []
    for path, keys in chunks:
        if store.lookup(keys) == len(keys) and os.path.exists(path):
            out.append((path, keys))
        else:
            out.append((faults.put_chunk(store, keys), keys))
    return out


def _read_fault_trials(fault, tmp_path, monkeypatch, rule: str) -> None:
    cfg = config(tmp_path / "cache")
    with KVStore(cfg, BIG) as store:
        chunks = fill(store, "reads", chunks=4)
    for trial in fault.trials(2, 8):
        p = 1.0 if trial % 2 == 0 else 0.5
        _set_faults(monkeypatch, f"{rule}:p={p}:seed={trial}")
        drop_page_cache(path for path, _ in chunks)
        keys = [k for _, ks in chunks for k in ks]
        with KVStore(cfg, BIG) as store:
            ok = fault.read_back(store, keys)
            counters = store.stats().counters
        (active,) = io_faults.faults_from_env()
        assert active.injected > 0, "the fault never fired: no read used the engine"
        assert ok.count(False) > 0
        assert counters["read_misses"] == ok.count(False)
        _set_faults(monkeypatch, None)
        with KVStore(cfg, BIG) as store:
            chunks = _restore(store, chunks)


@pytest.mark.fault("read-eio")
def test_read_eio_is_a_miss(fault, tmp_path, monkeypatch):
    _read_fault_trials(fault, tmp_path, monkeypatch, "read:eio")


@pytest.mark.fault("read-short")
def test_short_read_is_a_miss(fault, tmp_path, monkeypatch):
    _read_fault_trials(fault, tmp_path, monkeypatch, "read:short")


@pytest.mark.fault("read-eio-transient")
def test_transient_read_error_loses_nothing(fault, tmp_path, monkeypatch):
    """An I/O error that passes is not corruption: once the disk answers
    again, the blocks read (and read_errors counted the error)."""
    cfg = config(tmp_path / "cache")
    with KVStore(cfg, BIG) as store:
        chunks = fill(store, "transient", chunks=2)
    keys = [k for _, ks in chunks for k in ks]
    for trial in fault.trials(1, 3):
        _set_faults(monkeypatch, f"read:eio:count=1:seed={trial}")
        drop_page_cache(path for path, _ in chunks)
        with KVStore(cfg, BIG) as store:
            ok = fault.read_back(store, keys)
            errors = store.stats().counters["read_errors"]
        assert ok.count(False) > 0
        _set_faults(monkeypatch, None)
        with KVStore(cfg, BIG) as store:
            fault.durable(store, keys, f"trial {trial}: after one EIO,")
            chunks = _restore(store, chunks)
        assert errors > 0, "the I/O error was not counted in read_errors"


@pytest.mark.fault("read-eio-cached")
def test_eio_on_the_cached_path_is_a_miss(fault, tmp_path, monkeypatch):
    cfg = config(tmp_path / "cache")
    with KVStore(cfg, BIG) as store:
        chunks = fill(store, "cached", chunks=3)
    keys = [k for _, ks in chunks for k in ks]
    real = native.pread_layers_xxh3
    for trial in fault.trials(2, 6):
        calls = [0]

        def failing(fd, layer_parts, count, calls=calls, _every=trial % 2 + 1):
            calls[0] += 1
            if calls[0] % _every == 0:
                raise OSError(errno.EIO, "injected EIO")
            return real(fd, layer_parts, count)

        with KVStore(cfg, BIG) as store:
            fault.read_back(store, keys)  # admits the chunks to the page cache
            fault.read_back(store, keys)
            monkeypatch.setattr(native, "pread_layers_xxh3", failing)
            ok = fault.read_back(store, keys)
            monkeypatch.setattr(native, "pread_layers_xxh3", real)
            counters = store.stats().counters
            assert calls[0] > 0, "no read took the cached path"
            assert ok.count(False) > 0
            assert counters["read_errors"] > 0
            assert counters["cached_read_bytes"] > 0
            chunks = _restore(store, chunks)
            keys = [k for _, ks in chunks for k in ks]


@pytest.mark.fault("chunk-deleted-after-lookup")
def test_chunk_deleted_between_lookup_and_read(fault, tmp_path):
    cfg = config(tmp_path / "cache")
    with KVStore(cfg, BIG) as store:
        chunks = fill(store, "deleted", chunks=3)
        for trial in fault.trials(2, 6):
            victim = trial % len(chunks)
            path, keys = chunks[victim]
            assert store.lookup(keys) == len(keys)
            os.unlink(path)  # evicted or removed by another process
            drop_page_cache(p for p, _ in chunks if p != path)
            ok = fault.read_back(store, keys)
            assert not any(ok)
            others = [k for i, (_, ks) in enumerate(chunks) if i != victim for k in ks]
            fault.durable(store, others, f"trial {trial}:")
            fresh = faults.keys_for(f"deleted-again:{trial}", faults.BLOCKS)
            chunks[victim] = (faults.put_chunk(store, fresh), fresh)


@pytest.mark.fault("chunk-file-lost")
def test_blocks_of_a_lost_chunk_file_are_saved_again(fault, tmp_path):
    cfg = config(tmp_path / "cache")
    with KVStore(cfg, BIG) as store:
        for trial in fault.trials(1, 2):
            path, keys = fill(store, f"lost{trial}", chunks=1)[0]
            os.unlink(path)
            assert not any(fault.read_back(store, keys))
            again = store.put(keys, block_tensors(BIG, keys))
            assert again.stored == len(keys), (
                f"not saved again after the miss: {again}; lookup still claims "
                f"{store.lookup(keys)} of {len(keys)} blocks"
            )


@pytest.mark.fault("chunk-truncated-mid-read")
def test_chunk_cut_short_while_its_reads_are_in_flight(fault, tmp_path, monkeypatch):
    cfg = config(tmp_path / "cache")
    for trial in fault.trials(2, 6):
        root = tmp_path / f"t{trial}"
        with KVStore(faults.fresh_config(cfg, cache_dir=str(root)), BIG) as store:
            chunks = fill(store, f"cut{trial}", chunks=2)
        (path, keys), (_, other) = chunks
        cut = faults.data_start(path) + (trial + 1) * 50_000
        _set_faults(monkeypatch, "read:slow:ms=150")
        slept = _record_sleeps(monkeypatch)
        drop_page_cache(p for p, _ in chunks)
        timer = threading.Timer(0.05, os.truncate, (path, cut))
        with KVStore(faults.fresh_config(cfg, cache_dir=str(root)), BIG) as store:
            timer.start()
            ok = fault.read_back(store, keys + other)
            timer.join()
        _set_faults(monkeypatch, None)
        assert slept, "the read was not slowed (no slow rule fired)"
        assert ok[: len(keys)].count(False) > 0, "nothing past the cut missed"
        with KVStore(faults.fresh_config(cfg, cache_dir=str(root)), BIG) as store:
            fault.durable(store, other, f"trial {trial}:")
