"""KVStore in one process: put/lookup/read, layers, dedup, eviction order,
recovery of the index and of crash leftovers, and namespace isolation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from npukv_store import ConfigError, KVStore, NamespaceMismatch, StoreConfig
from npukv_store.hashing import chain_hashes
from npukv_store.store.directory import HOST
from npukv_store.store.format import build_chunk
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec
from tests.support.chunks import assert_chunks_open_with_safetensors


def put_prompt(store, tokens):
    keys = store.keys_for(tokens)
    return keys, store.put(keys, block_tensors(store.spec, keys))


def assert_reads_back(store, keys):
    out = empty_blocks(store.spec, len(keys))
    assert store.read(keys, out) == [True] * len(keys)
    for name, array in block_tensors(store.spec, keys).items():
        np.testing.assert_array_equal(out[name], array)


def test_put_lookup_read_roundtrip(store):
    keys, result = put_prompt(store, range(16 * 6 + 5))
    assert (result.stored, result.skipped, result.rejected) == (6, 0, 0)
    assert store.lookup(keys) == 6
    assert_reads_back(store, keys)
    stats = store.stats()
    assert stats.num_blocks == 6
    assert stats.num_chunks == 1
    assert stats.counters["put_blocks"] == 6


def test_partial_prefix_and_single_layer(store):
    keys, _ = put_prompt(store, range(16 * 4))
    longer = store.keys_for(list(range(16 * 4)) + [9] * 32)
    assert store.lookup(longer) == 4
    broken = [*keys[:2], b"\x00" * 16, keys[3]]
    assert store.lookup(broken) == 2
    layer = store.spec.layers[1]
    out = {n: np.zeros((2, 16, 2, 8), np.float16) for n in layer.tensor_names()}
    assert store.read(keys[1:3], out) == [True, True]
    expected = block_tensors(store.spec, keys[1:3])
    for name in layer.tensor_names():
        np.testing.assert_array_equal(out[name], expected[name])
    with pytest.raises(ValueError, match="needs all of"):
        store.read(
            keys[:1], {layer.tensor_names()[0]: out[layer.tensor_names()[0]][:1]}
        )


def test_stored_blocks_are_not_written_again(store):
    keys, _ = put_prompt(store, range(16 * 3))
    more = store.keys_for(range(16 * 5))
    result = store.put(more, block_tensors(store.spec, more))
    assert (result.stored, result.skipped) == (2, 3)
    assert store.stats().num_chunks == 2
    assert_reads_back(store, more)
    again = store.put(more, block_tensors(store.spec, more))
    assert (again.stored, again.skipped) == (0, 5)
    assert store.stats().num_chunks == 2


def test_bad_put_input_is_one_clear_error(store):
    keys = store.keys_for(range(32))
    tensors = block_tensors(store.spec, keys)
    with pytest.raises(ValueError, match="found .* expected"):
        store.put(keys, {k: v for k, v in list(tensors.items())[1:]})
    wrong = dict(
        tensors, **{"model.layers.0.attn.k": tensors["model.layers.0.attn.k"][:1]}
    )
    with pytest.raises(ValueError, match=r"found shape \[1, 16, 2, 8\]"):
        store.put(keys, wrong)
    with pytest.raises(ValueError, match="found dtype F32, expected F16"):
        store.put(keys, {k: v.astype(np.float32) for k, v in tensors.items()})
    with pytest.raises(ValueError, match="16-byte keys"):
        store.put([b"short"] * 2, tensors)


def test_torch_bf16_tensors(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is a [test] extra")
    from npukv_store import LayerSpec, NamespaceSpec, PartSpec

    spec = NamespaceSpec(
        model="m", block_size=4, kv_dtype="bfloat16",
        layers=(LayerSpec("l0", (PartSpec("kv", "BF16", (2, 4, 8)),)),),
    )  # fmt: skip
    with KVStore(StoreConfig(cache_dir=str(tmp_path / "c")), spec) as store:
        keys = store.keys_for(range(12))
        data = torch.randn(3, 2, 4, 8, dtype=torch.bfloat16)
        assert store.put(keys, {"l0.kv": data}).stored == 3
        out = torch.zeros_like(data)
        assert store.read(keys, {"l0.kv": out}) == [True] * 3
        assert torch.equal(out, data)
        assert store.check(verify_data=True) == []


def test_lru_eviction_respects_touches_and_capacity(tmp_path, spec):
    one_chunk = 4096 + 2 * spec.block_bytes + 2 * 3 * 8  # header, 2 blocks, sums
    config = StoreConfig(
        cache_dir=str(tmp_path / "c"), capacity=3 * one_chunk, evict_grace_s=0
    )
    with KVStore(config, spec) as store:
        chains = [put_prompt(store, [c] * 32)[0] for c in range(3)]
        assert store.stats().total_bytes == 3 * one_chunk
        store.lookup(chains[0])  # chain 0 becomes the youngest
        store.flush_touches()
        put_prompt(store, [7] * 32)
        assert store.lookup(chains[0]) == 2
        assert store.lookup(chains[1]) == 0  # the oldest untouched one went
        assert store.lookup(chains[2]) == 2
        assert store.stats().total_bytes <= config.capacity
        assert store.stats().counters["evicted_chunks"] == 1
        assert store.check(verify_data=True) == []


def test_grace_period_defers_the_unlink_of_hot_chunks(tmp_path, spec):
    """A hot chunk is evicted rather than the save refused, and its file
    waits for the grace (a reader that located it still reads it:
    docs/decisions/0070, tests/store/test_deferred_unlink.py)."""
    config = StoreConfig(cache_dir=str(tmp_path / "c"), capacity=15000)
    with KVStore(config, spec) as store:
        first, result = put_prompt(store, [1] * 32)
        assert result.stored == 2
        _, second = put_prompt(store, [2] * 32)
        assert (second.stored, second.rejected) == (2, 0)
        assert store.lookup(first) == 0
        assert store.check() == []


def test_index_rebuilt_when_missing_or_garbled(tmp_path, spec):
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, spec) as store:
        keys, _ = put_prompt(store, range(16 * 5))
        more, _ = put_prompt(store, range(100, 100 + 16 * 3))
    shutil.rmtree(tmp_path / "c" / "index")
    with KVStore(config, spec) as store:
        assert store.lookup(keys) == 5
        assert store.lookup(more) == 3
        assert_reads_back(store, keys)
        assert store.check(verify_data=True) == []
    with open(tmp_path / "c" / "index" / "data.mdb", "r+b") as handle:
        handle.write(os.urandom(8192))
    with KVStore(config, spec) as store:
        assert store.lookup(keys) == 5
        assert store.check(verify_data=True) == []


def test_crash_leftovers_removed_on_open(tmp_path, spec):
    """A process that opened the store and died without closing (its session
    record stays): the next open scans, and removes what it left."""
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, spec) as store:
        put_prompt(store, range(64))
        chunks = tmp_path / "c" / store.namespace / "chunks"
    opens_and_dies = (
        "import os, sys; from npukv_store import KVStore, StoreConfig; "
        "from tests.support.blocks import tiny_spec; "
        f"KVStore(StoreConfig(cache_dir={config.cache_dir!r}), tiny_spec()); "
        "print(os.getpid(), flush=True); os._exit(0)"
    )
    dead = subprocess.run([sys.executable, "-c", opens_and_dies],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    garbage = tmp_path / "c" / "tmp" / f"{dead_pid}-00ff.tmp"
    garbage.write_bytes(b"half a chunk")
    live = tmp_path / "c" / "tmp" / f"{os.getpid()}-00fe.tmp"
    live.write_bytes(b"in flight")
    keys = chain_hashes(range(64), 16, b"orphan", key=b"k" * 32)
    rows = {n: a.data.cast("B") for n, a in block_tensors(spec, keys).items()}
    buffers = build_chunk(
        spec, store.namespace, keys, rows, creator=f"{dead_pid}@{HOST}", created_ns=1
    )
    orphan = chunks / "00000000000000ff.safetensors"
    orphan.write_bytes(b"".join(bytes(b) for b in buffers))
    with KVStore(config, spec) as store:
        assert not garbage.exists()
        assert not orphan.exists()
        assert live.exists()  # its writer (us) is alive: maybe mid-publish
        live.unlink()
        assert store.check() == []


def test_namespaces_share_a_directory_without_mixing(tmp_path):
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with (
        KVStore(config, tiny_spec()) as a,
        KVStore(config, tiny_spec(tp_rank=1, tp_size=2)) as b,
    ):
        keys, _ = put_prompt(a, range(64))
        assert b.lookup(b.keys_for(range(64))) == 0
        assert b.read(keys, empty_blocks(b.spec, 4)) == [False] * 4
        assert a.stats().num_blocks == b.stats().num_blocks == 4  # one index
        assert a.check(verify_data=True) == []


def test_refuses_foreign_directory_and_tampered_namespace(tmp_path, spec):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(ConfigError, match="no NPUKV_STORE marker"):
        KVStore(StoreConfig(cache_dir=str(foreign)), spec)
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, spec) as store:
        ns_json = tmp_path / "c" / store.namespace / "namespace.json"
    ns_json.write_text('{"model": "other"}')
    with pytest.raises(NamespaceMismatch, match="namespace.json: holds"):
        KVStore(config, spec)


def test_concurrent_first_open_of_a_fresh_directory(tmp_path, spec):
    """Regression: threads creating the marker and namespace.json at once used
    one tmp name per pid and collided; a late opener could also take the first
    one's files for foreign ones."""
    import threading

    for trial in range(20):
        root = str(tmp_path / f"fresh{trial}")
        barrier = threading.Barrier(4)
        errors: list[BaseException] = []

        def open_close(root=root, barrier=barrier, errors=errors):
            barrier.wait()
            try:
                KVStore(StoreConfig(cache_dir=root), spec).close()
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=open_close) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []


@pytest.mark.parametrize("in_flight", [1, 2, 4])
def test_one_read_over_many_chunks_misses_only_the_corrupt_rows(
    tmp_path, spec, in_flight
):
    """A read spanning six chunks (keys interleaved across them) goes through
    several chunks at once; a corrupt row in one chunk is a miss for its key
    only, every other row comes back exact, and that chunk is quarantined."""
    from npukv_store.store.read.plan import ReadTuning

    config = StoreConfig(cache_dir=str(tmp_path / "c"), capacity="64MiB")
    tuning = ReadTuning(chunks_in_flight=in_flight)
    with KVStore(config, spec, read_tuning=tuning) as store:
        keys = []
        for prompt in range(6):
            chunk_keys, result = put_prompt(
                store, range(1000 * prompt, 1000 * prompt + 48)
            )
            assert result.stored == 3
            keys += chunk_keys
        victim_chunk = store.index.locate([keys[7]])[0][0]
        path = store.dir.chunk_path(store.namespace, victim_chunk)
        with open(path, "r+b") as handle:  # last byte: the last row of the last tensor
            handle.seek(-1, os.SEEK_END)
            last = handle.read(1)
            handle.seek(-1, os.SEEK_END)
            handle.write(bytes([last[0] ^ 0xFF]))
        victim_keys = {k for k in keys if store.index.locate([k])[0][0] == victim_chunk}
        order = np.random.default_rng(in_flight).permutation(len(keys))
        shuffled = [keys[i] for i in order]
        out = empty_blocks(spec, len(shuffled))
        ok = store.read(shuffled, out)
        misses = {k for k, hit in zip(shuffled, ok, strict=True) if not hit}
        assert len(misses) == 1
        assert misses <= victim_keys
        expected = block_tensors(spec, shuffled)
        for name, array in expected.items():
            for row, hit in enumerate(ok):
                if hit:
                    np.testing.assert_array_equal(out[name][row], array[row])
        assert store.stats().counters["quarantined_chunks"] == 1
        assert store.lookup(keys) == 6  # the victim's blocks are gone from the index
        assert not os.path.exists(path)
        assert store.check(verify_data=True) == []


def test_a_failed_read_task_raises_only_after_the_others_finished():
    """Reads of other chunks and of cached layers write into the caller's
    buffers: when one task fails, the call must not return (raise) while
    another is still writing."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from npukv_store.store.read.reader import _all_results

    release = threading.Event()
    finished = []

    def writer(i):
        release.wait(5)
        time.sleep(0.05)  # still writing when the failure is already known
        finished.append(i)
        return i

    def failing():
        release.set()  # the writers are still running when this one raises
        raise OSError("one chunk failed")

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(writer, 1), pool.submit(writer, 2)]
        futures.insert(0, pool.submit(failing))
        with pytest.raises(OSError, match="one chunk failed"):
            _all_results(futures)
        assert sorted(finished) == [1, 2]


@pytest.mark.parametrize("parent_first", [True, False])
def test_sibling_handles_share_one_ring_and_publish_each_namespace(
    tmp_path, parent_first
):
    """A hybrid model's KV cache groups: one namespace each, one staging ring
    for the process. Batches of both namespaces staged in the shared ring are
    published by the handle that staged them; closing either handle first
    loses nothing."""
    config = StoreConfig(cache_dir=str(tmp_path / "cache"), ring_size="4MiB")
    full, window = tiny_spec(model="hybrid"), tiny_spec(num_layers=2, model="hybrid")
    parent = KVStore(config, full)
    sibling = parent.sibling(window)
    assert sibling.namespace != parent.namespace
    assert sibling.ring_buffer() is parent.ring_buffer()
    keys_a = parent.keys_for(list(range(64)))
    keys_b = sibling.keys_for(list(range(64)))
    assert set(keys_a).isdisjoint(keys_b)  # seeded by their namespaces
    assert parent.put_async(keys_a, block_tensors(full, keys_a)).queued == 4
    assert sibling.put_async(keys_b, block_tensors(window, keys_b)).queued == 4
    first, second = (parent, sibling) if parent_first else (sibling, parent)
    first.close()
    second.close()
    with KVStore(config, full) as again, KVStore(config, window) as other:
        assert again.lookup(keys_a) == 4
        assert other.lookup(keys_b) == 4
        # one index for the directory: a handle sees every namespace's keys
        assert other.present([keys_a[0], b"\x00" * 16, keys_b[3]]) == [
            True, False, True,
        ]  # fmt: skip
        out = empty_blocks(window, 4)
        assert other.read(keys_b, out) == [True] * 4
        for name, rows in block_tensors(window, keys_b).items():
            np.testing.assert_array_equal(out[name], rows)
        assert again.check(verify_data=True) == []
    assert assert_chunks_open_with_safetensors(config.cache_dir) == 2


def test_cached_prefix_counts_leading_blocks_in_page_cached_chunks(store):
    keys_a, _ = put_prompt(store, range(16 * 3))  # chunk A: blocks 0-2
    tail = store.keys_for(range(16 * 6))[3:]  # the same chain, blocks 3-5
    store.put(tail, block_tensors(store.spec, tail))  # chunk B
    keys = keys_a + tail
    paths = {}
    for root, _, files in os.walk(store.config.cache_dir):
        paths.update(
            {f: os.path.join(root, f) for f in files if f.endswith(".safetensors")}
        )
    assert len(paths) == 2

    def drop(path):  # written and fsynced: its clean pages can be dropped
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    for path in paths.values():
        drop(path)
    assert store.cached_prefix(keys) == 0
    first = paths[f"{store.index.locate(keys[:1])[0][0]:016x}.safetensors"]  # A
    with open(first, "rb") as f:  # a buffered read fills the page cache
        f.read()
    assert store.cached_prefix(keys) == 3  # A cached, B not: stops at B
    assert store.cached_prefix(keys[3:]) == 0
    assert store.cached_prefix([b"\0" * 16, *keys]) == 0  # not stored: stops
