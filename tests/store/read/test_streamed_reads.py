"""Buffered reads of ranges the page cache does not hold, in segments larger
than one engine request, are streamed: one thread reads the chunk's layers in
file order with pread_rows_xxh3 (kernel readahead ahead of it) instead of
queue_depth engine requests at once. Every test runs with streaming on (the
threshold lowered to these small chunks) and off (the engine path), so both
paths keep the same contract: the exact bytes, or a miss."""

from __future__ import annotations

import os

import numpy as np
import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.store.format_checks import parse_header
from npukv_store.store.read import routes as read_routes
from npukv_store.store.read.plan import ReadTuning
from tests.support.blocks import block_tensors
from tests.support.chunks import (
    BLOCKS,
    aligned_out,
    chunk_files,
    evict_from_page_cache,
)


@pytest.fixture(params=[True, False], ids=["streamed", "engine"])
def streaming(request) -> ReadTuning:
    """Streaming on (for segments of any size here) or off."""
    return ReadTuning(stream_uncached=request.param, stream_above_bytes=0)


def counters_after_read(config, spec, keys, out, tuning=None, **overrides):
    cfg = StoreConfig(**{**config.__dict__, **overrides})
    with KVStore(cfg, spec, read_tuning=tuning) as store:
        ok = store.read(keys, out)
        return ok, store.stats().counters


def assert_rows_equal(out, expected, rows):
    for name, array in expected.items():
        np.testing.assert_array_equal(out[name][rows], array[rows])


def test_cold_unaligned_read_is_streamed_and_exact(stored, streaming):
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    out = aligned_out(spec, BLOCKS, misalign=64)  # like vLLM's CPU KV tensors
    ok, counters = counters_after_read(config, spec, keys, out, streaming)
    assert ok == [True] * BLOCKS
    assert_rows_equal(out, block_tensors(spec, keys), slice(None))
    assert counters["direct_read_bytes"] == 0
    expected = BLOCKS * spec.block_bytes if streaming.stream_uncached else 0
    assert counters["streamed_read_bytes"] == expected


def test_direct_io_off_cold_read_is_streamed(stored, streaming):
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    out = aligned_out(spec, BLOCKS)
    ok, counters = counters_after_read(
        config, spec, keys, out, streaming, direct_io=False
    )
    assert ok == [True] * BLOCKS
    assert_rows_equal(out, block_tensors(spec, keys), slice(None))
    assert counters["streamed_read_bytes"] == (
        BLOCKS * spec.block_bytes if streaming.stream_uncached else 0
    )


def test_scattered_rows_in_mixed_order_are_streamed_exactly(stored, streaming):
    """Keys asked in an order that is neither the file's nor its reverse, with
    gaps: each row still lands at its own key's index."""
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    picked = [5, 4, 3, 9, 10, 11, 40, 2, 63, 62]
    wanted = [keys[i] for i in picked]
    out = aligned_out(spec, len(picked), misalign=64)
    ok, counters = counters_after_read(config, spec, wanted, out, streaming)
    assert ok == [True] * len(picked)
    assert_rows_equal(out, block_tensors(spec, wanted), slice(None))
    assert counters["streamed_read_bytes"] == (
        len(picked) * spec.block_bytes if streaming.stream_uncached else 0
    )


def test_direct_and_streamed_layers_in_one_call(stored, streaming):
    """Layer 0 into aligned buffers (O_DIRECT, the engine), layer 1 into
    unaligned ones (streamed on a verifier thread meanwhile)."""
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    out = aligned_out(spec, BLOCKS)
    unaligned = aligned_out(spec, BLOCKS, misalign=64)
    for name in out:
        if name.startswith("layers.1."):
            out[name] = unaligned[name]
    ok, counters = counters_after_read(config, spec, keys, out, streaming)
    assert ok == [True] * BLOCKS
    assert_rows_equal(out, block_tensors(spec, keys), slice(None))
    half = BLOCKS * spec.block_bytes // 2
    assert counters["direct_read_bytes"] == half
    assert counters["streamed_read_bytes"] == (half if streaming.stream_uncached else 0)


def flip_byte(path, layer: int, part: int, row: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        entry = parse_header(fd, str(path)).layers[layer][part]
        offset = entry.begin + row * entry.row_bytes + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_corrupt_row_read_streamed_is_a_miss(stored, streaming):
    config, spec, keys = stored
    (path,) = chunk_files(config.cache_dir).values()
    flip_byte(path, layer=1, part=1, row=7)
    evict_from_page_cache(config.cache_dir)
    out = aligned_out(spec, BLOCKS, misalign=64)
    ok, counters = counters_after_read(config, spec, keys, out, streaming)
    assert ok == [i != 7 for i in range(BLOCKS)]  # the bad block alone
    assert counters["checksum_errors"] >= 1
    good = [i for i in range(BLOCKS) if i != 7]
    assert_rows_equal(out, block_tensors(spec, keys), good)


def test_verify_never_streams_without_judging(stored, streaming):
    """verify=never trusts the disk on both paths: the flipped byte is served
    (that is what the setting means) and nothing is counted as a mismatch."""
    config, spec, keys = stored
    (path,) = chunk_files(config.cache_dir).values()
    flip_byte(path, layer=0, part=0, row=2)
    evict_from_page_cache(config.cache_dir)
    out = aligned_out(spec, BLOCKS, misalign=64)
    ok, counters = counters_after_read(
        config, spec, keys, out, streaming, verify="never"
    )
    assert ok == [True] * BLOCKS
    assert counters["checksum_errors"] == 0
    expected = block_tensors(spec, keys)
    assert not np.array_equal(out["layers.0.k"][2], expected["layers.0.k"][2])
    assert_rows_equal(out, {"layers.1.v": expected["layers.1.v"]}, slice(None))


def test_a_chunk_truncated_after_its_header_was_cached_is_a_miss(stored, streaming):
    """A short read in the middle of the stream (the file now ends early)
    makes the rows it covers misses, never zeros served as KV."""
    config, spec, keys = stored
    (path,) = chunk_files(config.cache_dir).values()
    with open(path, "rb") as handle:
        header = parse_header(handle.fileno(), str(path))
    last = header.layers[1][1]
    with KVStore(config, spec, read_tuning=streaming) as store:
        out = aligned_out(spec, BLOCKS, misalign=64)
        assert store.read(keys, out) == [True] * BLOCKS  # header now cached
        os.truncate(path, last.begin + 10 * last.row_bytes)
        evict_from_page_cache(config.cache_dir)
        out = aligned_out(spec, BLOCKS, misalign=64)
        ok = store.read(keys, out)
        counters = store.stats().counters
    assert ok == [False] * BLOCKS  # the cut run fails as a whole
    assert counters["read_errors"] + counters["checksum_errors"] >= 1


def test_only_segments_larger_than_one_request_are_streamed(tmp_path):
    """At the default threshold (one engine request, 4 MiB) a layer of 256 KiB
    segments stays on the engine and one of 5 MiB segments is streamed."""
    from npukv_store import LayerSpec, NamespaceSpec, PartSpec

    part = (PartSpec("kv", "U8", (64 << 10,)),)
    spec = NamespaceSpec(
        model="stream-threshold", block_size=16, kv_dtype="uint8",
        layers=(LayerSpec("small", part), LayerSpec("large", part)),
    )  # fmt: skip
    config = StoreConfig(cache_dir=str(tmp_path / "cache"), capacity="256MiB")
    rows = 80  # 5 MiB per segment when the whole chunk is read
    rng = np.random.default_rng(3)
    data = {
        n: rng.integers(0, 255, (rows, 64 << 10), np.uint8) for n in spec.tensor_names()
    }
    with KVStore(config, spec) as store:
        keys = store.keys_for(np.arange(16 * rows))
        assert store.put(keys, data).stored == rows
    evict_from_page_cache(config.cache_dir)
    small = {"small.kv": np.zeros((4, 64 << 10), np.uint8)}  # 256 KiB
    ok, counters = counters_after_read(config, spec, keys[:4], small)
    assert ok == [True] * 4
    assert counters["streamed_read_bytes"] == 0
    np.testing.assert_array_equal(small["small.kv"], data["small.kv"][:4])
    evict_from_page_cache(config.cache_dir)
    large = {"large.kv": np.zeros((rows, 64 << 10), np.uint8)}  # 5 MiB
    ok, counters = counters_after_read(config, spec, keys, large)
    assert ok == [True] * rows
    assert counters["streamed_read_bytes"] == rows * (64 << 10)
    np.testing.assert_array_equal(large["large.kv"], data["large.kv"])


@pytest.mark.parametrize(
    "splits",
    [
        [range(0, 20), range(20, 64)],  # adjacent in the file
        [range(63, 40, -1), range(0, 10), range(10, 12)],  # descending, then up
    ],
    ids=["adjacent", "mixed"],
)
def test_read_many_cold_fills_every_request(stored, streaming, splits):
    """vLLM's loads: one request per run of block ids, one call, cold."""
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    asked = [[keys[i] for i in split] for split in splits]
    outs = [aligned_out(spec, len(k), misalign=64) for k in asked]
    cfg = StoreConfig(**config.__dict__)
    with KVStore(cfg, spec, read_tuning=streaming) as store:
        ok = store.read_many(list(zip(asked, outs, strict=True)))
        counters = store.stats().counters
    assert ok == [[True] * len(k) for k in asked]
    total = sum(len(k) for k in asked) * spec.block_bytes
    assert counters["streamed_read_bytes"] == (
        total if streaming.stream_uncached else 0
    )
    for wanted, out in zip(asked, outs, strict=True):
        assert_rows_equal(out, block_tensors(spec, wanted), slice(None))


@pytest.mark.parametrize("tasks", [1, 2, 3, 64])
def test_cached_layers_in_few_tasks_read_every_layer(tmp_path, tasks):
    """Warm reads group a chunk's cached layers into a few verifier tasks:
    every layer still arrives, verified, whatever the grouping."""
    from tests.support.blocks import tiny_spec

    spec = tiny_spec(num_layers=7)
    config = StoreConfig(cache_dir=str(tmp_path / "cache"), capacity="64MiB")
    keys = [bytes([i, 3]) * 8 for i in range(12)]
    tuning = ReadTuning(cached_tasks_per_chunk=tasks)
    with KVStore(config, spec, read_tuning=tuning) as store:
        assert store.put(keys, block_tensors(spec, keys)).stored == len(keys)
        out = {
            name: np.zeros_like(array)
            for name, array in block_tensors(spec, keys).items()
        }
        assert store.read(keys[2:], {n: a[2:] for n, a in out.items()}) == [True] * 10
        counters = store.stats().counters
    assert counters["cached_read_bytes"] == 10 * spec.block_bytes
    expected = block_tensors(spec, keys)
    for name in out:
        np.testing.assert_array_equal(out[name][2:], expected[name][2:])


def test_a_stream_of_several_runs_goes_through_the_file_layer_by_layer(
    stored, monkeypatch
):
    """Two runs of rows (vLLM's two runs of block ids, one read_many): the
    stream reads layer 0's runs, then layer 1's, never back to an earlier
    layer, so readahead stays ahead of it. Cached reads, where order does not
    matter, take all of a task's layers in one call per run instead."""
    config, spec, keys = stored
    tuning = ReadTuning(stream_above_bytes=0)
    (path,) = chunk_files(config.cache_dir).values()
    fd = os.open(path, os.O_RDONLY)
    try:
        header = parse_header(fd, str(path))
    finally:
        os.close(fd)

    def layer_of(offset: int) -> int:
        (index,) = [
            li
            for li, entries in enumerate(header.layers)
            if entries[0].begin <= offset < entries[-1].end
        ]
        return index

    streamed: list[list[int]] = []
    real = read_routes.native.pread_layers_xxh3

    def spy(fd, layers, rows):
        streamed.append([layer_of(parts[0][0]) for parts in layers])
        return real(fd, layers, rows)

    monkeypatch.setattr(read_routes.native, "pread_layers_xxh3", spy)
    asked = [keys[:20], keys[20:]]
    outs = [aligned_out(spec, len(k), misalign=64) for k in asked]
    for cold in (True, False):
        streamed.clear()
        if cold:
            evict_from_page_cache(config.cache_dir)
        with KVStore(StoreConfig(**config.__dict__), spec, read_tuning=tuning) as store:
            ok = store.read_many(list(zip(asked, outs, strict=True)))
            if cold:
                assert store.stats().counters["streamed_read_bytes"] > 0
        assert ok == [[True] * 20, [True] * 44]
        for wanted, out in zip(asked, outs, strict=True):
            assert_rows_equal(out, block_tensors(spec, wanted), slice(None))
        order = [li for call in streamed for li in call]
        if cold:
            assert order == [0, 0, 1, 1]  # per layer, its two runs
        else:
            assert sorted(order) == [0, 0, 1, 1]
            assert len(streamed) <= 2 * tuning.cached_tasks
