"""Reads around the page cache (``direct_io``): the first read of a chunk whose
pages are not cached goes O_DIRECT into aligned buffers, the second read is
buffered and admits it to the cache, and anything unaligned stays buffered.
Verification applies to direct reads exactly as to buffered ones."""

from __future__ import annotations

import os

import numpy as np

from npukv_store import KVStore, StoreConfig
from npukv_store.store.format_checks import parse_header
from tests.support.blocks import block_tensors
from tests.support.chunks import (
    BLOCKS,
    aligned_out,
    cached_share,
    chunk_files,
    evict_from_page_cache,
)


def read_all(config, spec, keys, out, **overrides):
    cfg = StoreConfig(**{**config.__dict__, **overrides}) if overrides else config
    with KVStore(cfg, spec) as store:
        ok = store.read(keys, out)
        direct = store.stats().counters["direct_read_bytes"]
        again = store.read(keys, out)
        direct_again = store.stats().counters["direct_read_bytes"] - direct
    expected = block_tensors(spec, keys)
    for name, array in expected.items():
        np.testing.assert_array_equal(out[name], array)
    assert ok == again == [True] * len(keys)
    return direct, direct_again


def test_first_read_is_direct_and_the_second_admits_the_chunk(stored):
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    with KVStore(config, spec) as store:
        out = aligned_out(spec, BLOCKS)
        assert store.read(keys, out) == [True] * BLOCKS
        assert store.stats().counters["direct_read_bytes"] == BLOCKS * spec.block_bytes
        assert cached_share(config.cache_dir) < 0.5  # went around the cache
        for name, array in block_tensors(spec, keys).items():
            np.testing.assert_array_equal(out[name], array)
        out = aligned_out(spec, BLOCKS)
        assert store.read(keys, out) == [True] * BLOCKS  # second read: buffered
        assert store.stats().counters["direct_read_bytes"] == BLOCKS * spec.block_bytes
    assert cached_share(config.cache_dir) > 0.5  # now admitted
    for name, array in block_tensors(spec, keys).items():
        np.testing.assert_array_equal(out[name], array)


def test_cached_pages_are_read_from_the_cache(stored):
    config, spec, keys = stored  # just written (buffered put): cached
    direct, _ = read_all(config, spec, keys, aligned_out(spec, BLOCKS))
    assert direct == 0


def test_unaligned_buffers_and_direct_io_off_stay_buffered(stored):
    config, spec, keys = stored
    evict_from_page_cache(config.cache_dir)
    direct, _ = read_all(config, spec, keys, aligned_out(spec, BLOCKS, misalign=64))
    assert direct == 0
    evict_from_page_cache(config.cache_dir)
    direct, _ = read_all(config, spec, keys, aligned_out(spec, BLOCKS), direct_io=False)
    assert direct == 0


def test_a_corrupt_row_read_direct_is_a_miss(stored):
    config, spec, keys = stored
    (path,) = chunk_files(config.cache_dir).values()
    fd = os.open(path, os.O_RDWR)
    try:  # flip one byte of block 3, layer 0, part k
        entry = parse_header(fd, str(path)).layers[0][0]
        offset = entry.begin + 3 * entry.row_bytes + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    evict_from_page_cache(config.cache_dir)
    with KVStore(config, spec) as store:
        out = aligned_out(spec, BLOCKS)
        ok = store.read(keys, out)
        counters = store.stats().counters
    assert counters["direct_read_bytes"] > 0
    assert ok == [i != 3 for i in range(BLOCKS)]  # the bad block alone is a miss
    assert counters["checksum_errors"] >= 1
