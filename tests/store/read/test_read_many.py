"""``KVStore.read_many``: several ``(keys, out)`` requests in one call, each
chunk file read once whatever request its rows fill. The property: it gives
exactly what a ``read`` per request gives, for any split of any keys."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from npukv_store import KVStore, StoreConfig
from npukv_store.store.read import reader as chunk_reader
from npukv_store.store.read.plan import ReadTuning
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec

CHUNKS, ROWS = 3, 8


@pytest.fixture(scope="module")
def filled():
    """Three chunks of 8 blocks each; keys[k] of chunk c is c * ROWS + k."""
    root = tempfile.mkdtemp(prefix="read-many-")
    spec = tiny_spec()
    config = StoreConfig(cache_dir=os.path.join(root, "cache"), capacity="64MiB")
    keys = [bytes([c, k]) * 8 for c in range(CHUNKS) for k in range(ROWS)]
    with KVStore(config, spec) as store:
        for c in range(CHUNKS):
            chunk = keys[c * ROWS : (c + 1) * ROWS]
            assert store.put(chunk, block_tensors(spec, chunk)).stored == ROWS
    yield config, spec, keys
    shutil.rmtree(root)


def drop_chunk_pages(cache_dir: str) -> None:
    """Best effort: these chunks are small enough that the header read's
    readahead may cache them again (the cached path), and tmpfs keeps them;
    the property holds on every path. Cold reads of large chunks through
    read_many are in test_streamed_reads.py."""
    for path in pathlib.Path(cache_dir).rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def expect_rows(spec, keys, out, ok) -> None:
    """Rows read (ok) hold the key's bytes."""
    if not keys:
        return
    expected = block_tensors(spec, keys)
    for name, array in out.items():
        for row, hit in enumerate(ok):
            if hit:
                np.testing.assert_array_equal(array[row], expected[name][row])


requests_strategy = st.lists(
    st.lists(st.integers(0, CHUNKS * ROWS + 2), min_size=0, max_size=10),
    min_size=1,
    max_size=4,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(requests_strategy, st.booleans())
@example([[0, 1, 2], [3, 4, 5]], True)  # requests adjacent in the file
@example([[2, 1, 0], [5, 4, 3]], False)
def test_read_many_equals_one_read_per_request(filled, picks, streamed):
    """Indices past the stored keys are keys never stored (misses)."""
    config, spec, keys = filled
    unknown = {i: bytes([99, i]) * 8 for i in range(CHUNKS * ROWS, CHUNKS * ROWS + 3)}
    asked = [[keys[i] if i < len(keys) else unknown[i] for i in p] for p in picks]
    # these chunks' segments are small: stream them all, or none
    tuning = ReadTuning(stream_uncached=streamed, stream_above_bytes=0)
    with KVStore(config, spec, read_tuning=tuning) as store:
        outs = [empty_blocks(spec, len(k)) for k in asked]
        drop_chunk_pages(config.cache_dir)  # the header read may cache it again
        many = store.read_many(list(zip(asked, outs, strict=True)))
        singles = []
        for wanted in asked:
            drop_chunk_pages(config.cache_dir)
            single_out = empty_blocks(spec, len(wanted))
            singles.append(store.read(wanted, single_out))
    assert many == singles
    for wanted, out, ok in zip(asked, outs, many, strict=True):
        assert ok == [k in keys for k in wanted]
        expect_rows(spec, wanted, out, ok)


def test_each_chunk_is_read_once_for_all_requests(filled, monkeypatch):
    """vLLM's pages: one prompt's blocks in two runs of ids, two buffers. One
    read_many reads the chunk once (one read_rows), rows in file order."""
    config, spec, keys = filled
    calls = []
    original = chunk_reader.ChunkReader.read_rows

    def counting(self, chunk_id, items, *args):
        calls.append((chunk_id, sorted(row for _, row in items)))
        return original(self, chunk_id, items, *args)

    monkeypatch.setattr(chunk_reader.ChunkReader, "read_rows", counting)
    # adjacent in the file, and a descending run (vLLM's freed block ids)
    asked = [keys[0:3], keys[3:5], keys[5:8][::-1]]
    outs = [empty_blocks(spec, len(k)) for k in asked]
    with KVStore(config, spec) as store:
        ok = store.read_many(list(zip(asked, outs, strict=True)))
    assert ok == [[True] * len(k) for k in asked]
    assert len(calls) == 1
    assert calls[0][1] == list(range(8))
    for wanted, out, hits in zip(asked, outs, ok, strict=True):
        expect_rows(spec, wanted, out, hits)


def test_requests_must_name_the_same_tensors(filled):
    config, spec, keys = filled
    full = empty_blocks(spec, 2)
    one_layer = {n: a for n, a in full.items() if n.startswith(spec.layers[0].name)}
    with KVStore(config, spec) as store:
        assert store.read_many([]) == []
        with pytest.raises(ValueError, match="request 1 names layers"):
            store.read_many([(keys[:2], full), (keys[2:4], one_layer)])
