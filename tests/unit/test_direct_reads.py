"""Reads around the page cache (``direct_io``): the first read of a chunk whose
pages are not cached goes O_DIRECT into aligned buffers, the second read is
buffered and admits it to the cache, and anything unaligned stays buffered.
Verification applies to direct reads exactly as to buffered ones."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from npukv_store import KVStore, LayerSpec, NamespaceSpec, PartSpec, StoreConfig
from npukv_store.io.direct import aligned_buffer
from npukv_store.native import page_residency
from npukv_store.store.format import parse_header
from tests.conftest import block_tensors

BLOCKS = 64  # 1 MiB of data: the header read (64 KiB) caches little of it


def aligned_spec():
    """Rows of exactly one 4096-byte page per part: [16 tokens, 8 heads, 16] F16."""
    parts = (PartSpec("k", "F16", (16, 8, 16)), PartSpec("v", "F16", (16, 8, 16)))
    layers = tuple(LayerSpec(f"layers.{i}", parts) for i in range(2))
    return NamespaceSpec(
        model="direct-reads", block_size=16, kv_dtype="float16", layers=layers
    )


def aligned_out(spec, rows: int, misalign: int = 0) -> dict[str, np.ndarray]:
    out = {}
    for layer in spec.layers:
        for part in layer.parts:
            raw = aligned_buffer(rows * part.row_bytes + misalign)[misalign:]
            out[f"{layer.name}.{part.name}"] = raw.view(np.float16).reshape(
                rows, *part.row_shape
            )
    return out


def chunk_files(cache_dir: str) -> list[pathlib.Path]:
    return sorted(pathlib.Path(cache_dir).rglob("*.safetensors"))


def evict_from_page_cache(cache_dir: str) -> None:
    """Drop the (clean, fsynced) pages of every chunk file; skip where the
    filesystem keeps them regardless (tmpfs), since nothing is then cold."""
    for path in chunk_files(cache_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if page_residency(fd, 0, os.fstat(fd).st_size).any():
                pytest.skip(f"{path.parent} keeps file pages resident (tmpfs?)")
        finally:
            os.close(fd)


def cached_share(cache_dir: str) -> float:
    pages = []
    for path in chunk_files(cache_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            pages.append(page_residency(fd, 0, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return float(np.concatenate(pages).mean())


@pytest.fixture
def stored(tmp_path):
    spec = aligned_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "cache"), capacity="64MiB")
    keys = [bytes([i, 7]) * 8 for i in range(BLOCKS)]
    with KVStore(config, spec) as store:
        assert store.put(keys, block_tensors(spec, keys)).stored == BLOCKS
    return config, spec, keys


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
    (path,) = chunk_files(config.cache_dir)
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
