"""put_async and the background writer: staged batches become chunks after
flush(); a full ring drops instead of waiting; device events are waited on;
close() drains complete batches and drops incomplete ones; a failed batch is
counted, releases its keys and does not stop the writer."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.store.write import staging as saver
from tests.support.blocks import block_tensors, empty_blocks


@pytest.fixture
def config(tmp_path):
    return StoreConfig(cache_dir=str(tmp_path / "c"), ring_size="256KiB")


def assert_reads_back(store, keys):
    out = empty_blocks(store.spec, len(keys))
    assert store.read(keys, out) == [True] * len(keys)
    for name, array in block_tensors(store.spec, keys).items():
        np.testing.assert_array_equal(out[name], array)


def test_put_async_then_flush_publishes(config, spec):
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(16 * 8))
        first = store.put_async(keys[:3], block_tensors(spec, keys[:3]))
        second = store.put_async(keys, block_tensors(spec, keys))
        assert (first.queued, second.queued, second.skipped) == (3, 5, 3)
        assert store.flush(timeout_s=30)
        assert store.lookup(keys) == 8
        assert_reads_back(store, keys)
        ring_path = store._async.ring.path
        assert os.path.exists(ring_path)
        assert store.check(verify_data=True) == []
        engine = store._async._engine
        if engine.kind == "uring":  # the ring is registered: writes skip pinning
            assert engine.fixed_submitted > 0
    assert not os.path.exists(ring_path)  # a clean close unlinks the ring


class Gate:
    """Holds the writer inside publish until opened, to fill the ring."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        self.entered = threading.Event()
        real = saver.publish_image

        def gated(*args, **kwargs):
            self.entered.set()
            self.open.wait(30)
            return real(*args, **kwargs)

        monkeypatch.setattr(saver, "publish_image", gated)


def test_full_ring_drops_and_never_waits(config, spec, monkeypatch):
    gate = Gate(monkeypatch)
    with KVStore(config, spec) as store:
        chains = [store.keys_for([c] * 16 * 8) for c in range(20)]
        results = [store.put_async(k, block_tensors(spec, k)) for k in chains]
        # 256 KiB holds a few 8-block batches (28 KiB each); the writer is stuck
        assert sum(r.dropped for r in results) > 0
        assert store.flush(timeout_s=0.2) is False  # still gated
        gate.open.set()
        assert store.flush(timeout_s=30)
        queued = [k for k, r in zip(chains, results, strict=True) if r.queued]
        dropped = [k for k, r in zip(chains, results, strict=True) if r.dropped]
        for keys in queued:
            assert store.lookup(keys) == 8
        assert all(store.lookup(keys) == 0 for keys in dropped)
        counters = store.stats().counters
        assert counters["dropped_blocks"] == 8 * len(dropped)
        # dropped keys were released: a later save takes them
        again = store.put_async(dropped[0], block_tensors(spec, dropped[0]))
        assert again.queued == 8


class FakeEvent:
    def __init__(self, done):
        self.done = done
        self.synchronized = False

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized = True
        self.done = True


def test_events_are_waited_on_and_incomplete_batches_dropped_at_close(
    config, spec, monkeypatch
):
    gate = Gate(monkeypatch)
    store = KVStore(config, spec)
    keys = store.keys_for(range(16 * 4))
    complete = FakeEvent(done=False)
    store.put_async(keys[:2], block_tensors(spec, keys[:2]), event=complete)
    assert gate.entered.wait(10)  # first batch is being published...
    assert complete.synchronized  # ...after its event was waited on
    never = FakeEvent(done=False)
    never.synchronize = lambda: pytest.fail("close() must not wait on it")
    store.put_async(keys[2:], block_tensors(spec, keys[2:]), event=never)
    gate.open.set()
    store.close()  # drains the first, drops the second
    with KVStore(config, spec) as again:
        assert again.lookup(keys) == 2
        assert again.check() == []


def test_failed_batch_is_counted_and_writer_goes_on(config, spec, monkeypatch):
    real = saver.publish_image
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(saver, "publish_image", flaky)
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(16 * 2))
        store.put_async(keys, block_tensors(spec, keys))
        assert store.flush(timeout_s=30)
        assert store.stats().counters["failed_batches"] == 1
        assert store.lookup(keys) == 0
        assert store.put_async(keys, block_tensors(spec, keys)).queued == 2
        assert store.flush(timeout_s=30)
        assert_reads_back(store, keys)
        assert store.check() == []


@pytest.mark.parametrize("kind", ["threads", "uring"])
def test_failed_image_write_leaves_no_request_in_flight(tmp_path, kind):
    """A failed piece raises IOEngineError and the engine is drained, so the
    next chunk written with the same engine sees none of this one's completions."""
    from npukv_store.errors import IOEngineError
    from npukv_store.io.engine import make_engine
    from npukv_store.io.writer import WRITE_PIECE_BYTES, write_image

    try:
        engine = make_engine(kind, 4)
    except Exception as exc:  # ConfigError where io_uring cannot start
        pytest.skip(f"{kind} engine unavailable here: {exc}")
    image = np.ones(WRITE_PIECE_BYTES * 6 + 100, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(b"")
    hashed = []
    readonly = os.open(path, os.O_RDONLY)  # every write fails with EBADF
    try:
        with pytest.raises(IOEngineError, match="chunk write at offset"):
            write_image(
                engine, readonly, image, tail_offset=image.size - 100,
                fill_tail=lambda: hashed.append(True),
            )  # fmt: skip
        assert engine.in_flight == 0
        assert hashed == [True]  # the tail was still filled before raising
        writable = os.open(path, os.O_WRONLY)
        try:
            assert write_image(engine, writable, image) == image.size
        finally:
            os.close(writable)
        assert path.stat().st_size == image.size
    finally:
        os.close(readonly)
        engine.close()


def test_failed_staging_releases_the_claimed_keys(tmp_path, spec):
    """Regression: a ring that cannot be created raised out of put_async with
    the keys still marked in flight, so this handle never saved them again."""
    from npukv_store.errors import ConfigError

    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    config = StoreConfig(cache_dir=str(tmp_path / "c"), ring_size=free + (1 << 30))
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(32))
        with pytest.raises(ConfigError, match="ring_size"):
            store.put_async(keys, block_tensors(spec, keys))
        assert store.put(keys, block_tensors(spec, keys)).stored == 2


def _fill_layerwise(store, staged, rows):
    """What the connector's device copies do: each layer's rows at its address."""
    spec = store.spec
    for index, layer in enumerate(spec.layers):
        offset = staged.layer_address(index) - staged.image.ctypes.data
        for part in layer.parts:
            data = rows[f"{layer.name}.{part.name}"][staged.indices]
            flat = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            staged.image[offset : offset + flat.size] = flat
            offset += flat.size


def test_begin_save_filled_layer_by_layer_publishes(config, spec):
    """begin_save claims only fresh keys, lays the region out as the chunk, and
    a batch filled layer by layer reads back exactly."""
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(16 * 6))
        store.put(keys[:2], block_tensors(spec, keys[:2]))
        rows = block_tensors(spec, keys)
        staged = store.begin_save(keys)
        assert staged is not None
        assert staged.indices == [2, 3, 4, 5]
        assert store.begin_save(keys) is None  # all stored or in flight now
        _fill_layerwise(store, staged, rows)
        store.commit_save(staged, event=None)
        assert store.flush(timeout_s=30)
        assert store.lookup(keys) == 6
        out = empty_blocks(spec, 6)
        assert store.read(keys, out) == [True] * 6
        for name, array in rows.items():
            np.testing.assert_array_equal(out[name], array)
        assert store.check(verify_data=True) == []


def test_abort_save_releases_keys_and_region(config, spec):
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(16 * 3))
        staged = store.begin_save(keys)
        assert staged is not None
        store.abort_save(staged)
        assert store.stats().counters["dropped_blocks"] == 3
        again = store.begin_save(keys)  # the keys can be saved again
        assert again is not None
        assert again.indices == [0, 1, 2]
        _fill_layerwise(store, again, block_tensors(spec, keys))
        store.commit_save(again)
        assert store.flush(timeout_s=30)
        assert store.lookup(keys) == 3
        assert store.check(verify_data=True) == []


def test_begin_save_on_a_full_ring_drops(tmp_path, spec):
    config = StoreConfig(cache_dir=str(tmp_path / "c"), ring_size="64KiB")
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(16 * 40))  # 40 blocks of 3 KiB: > 64 KiB
        assert store.begin_save(keys) is None
        assert store.stats().counters["dropped_blocks"] == 40
        assert store.begin_save(keys[:2]) is not None  # keys were released


@pytest.mark.parametrize("direct", [False, True])
def test_publish_image_sizes_the_file_before_the_first_write(tmp_path, direct):
    """With O_DIRECT every piece is written inside i_size, never past it: on
    ext4 an extending O_DIRECT write is serialised (io_uring punts it), so
    unsized files wrote at 1.03 against 1.16 GB/s. Buffered writes extend the
    file as they go. Either way the published file has exactly the image's
    bytes: the alignment padding is cut off."""
    from npukv_store.io.direct import align_up, aligned_buffer
    from npukv_store.io.engine import make_engine
    from npukv_store.io.writer import WRITE_PIECE_BYTES
    from npukv_store.store.directory import CacheDir
    from npukv_store.store.write.chunk_file import publish_image

    cdir = CacheDir(str(tmp_path / "cache"))
    cdir.open()
    namespace = "ab" * 16
    cdir.ensure_namespace(namespace, "{}")
    size = WRITE_PIECE_BYTES * 3 + 12345
    padded = aligned_buffer(align_up(size))
    image = padded[:size]
    image[:] = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8)
    engine = make_engine("threads", 4)
    sizes_seen: list[int] = []
    real_submit = engine.submit

    def recording_submit(requests):
        for request in requests:
            sizes_seen.append(os.fstat(request.fd).st_size)
        real_submit(requests)

    engine.submit = recording_submit  # type: ignore[method-assign]
    try:
        path, written = publish_image(
            cdir, namespace, 7, image, engine, sync=True,
            padded=padded if direct else None,
        )  # fmt: skip
    finally:
        engine.close()
    assert len(sizes_seen) == 4  # pieces of WRITE_PIECE_BYTES
    if direct:
        assert set(sizes_seen) == {padded.nbytes}
    else:  # not sized: the first piece extends an empty file
        assert sizes_seen[0] == 0
    assert written == size
    with open(path, "rb") as published:
        assert published.read() == image.tobytes()
