"""A read over several chunks parses every uncached header before it asks for
any chunk's data (ChunkHeaders.prefetch, docs/decisions/0020): read chunk by
chunk, a cold header waited in the disk's queue behind the other chunk's data.
A header that fails to parse there is left for the chunk's own read, which
counts and reports it once."""

from __future__ import annotations

import numpy as np
import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.store.read import headers as chunk_headers
from npukv_store.store.read import reader as chunk_reader
from npukv_store.store.read.plan import ReadTuning
from tests.support.blocks import block_tensors, empty_blocks


def store_six_chunks(path, spec) -> list[bytes]:
    """Six chunks of three blocks; returns every key, chunk by chunk."""
    keys: list[bytes] = []
    with KVStore(StoreConfig(cache_dir=str(path), capacity="64MiB"), spec) as store:
        for prompt in range(6):
            chunk_keys = store.keys_for(range(1000 * prompt, 1000 * prompt + 48))
            assert store.put(chunk_keys, block_tensors(spec, chunk_keys)).stored == 3
            keys += chunk_keys
    return keys


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_every_header_is_parsed_once_and_before_any_data(
    tmp_path, spec, monkeypatch, in_flight
):
    keys = store_six_chunks(tmp_path / "c", spec)
    events: list[str] = []
    parse = chunk_headers.parse_header
    read_layers = chunk_reader.ChunkReader._read_layers

    def logged_parse(fd, path, **kwargs):
        events.append("header")
        return parse(fd, path, **kwargs)

    def logged_read_layers(self, *args):
        events.append("data")
        return read_layers(self, *args)

    monkeypatch.setattr(chunk_headers, "parse_header", logged_parse)
    monkeypatch.setattr(chunk_reader.ChunkReader, "_read_layers", logged_read_layers)
    config = StoreConfig(cache_dir=str(tmp_path / "c"), capacity="64MiB")
    tuning = ReadTuning(chunks_in_flight=in_flight)
    # a fresh handle: no header cached
    with KVStore(config, spec, read_tuning=tuning) as store:
        order = np.random.default_rng(in_flight).permutation(len(keys))
        shuffled = [keys[i] for i in order]
        out = empty_blocks(spec, len(shuffled))
        assert store.read(shuffled, out) == [True] * len(shuffled)
        for name, array in block_tensors(spec, shuffled).items():
            np.testing.assert_array_equal(out[name], array)
        assert events == ["header"] * 6 + ["data"] * 6
        events.clear()
        assert all(store.read(keys, empty_blocks(spec, len(keys))))
        assert events == ["data"] * 6  # from the cache the second time


def test_a_header_that_fails_to_parse_is_one_miss_counted_once(tmp_path, spec):
    keys = store_six_chunks(tmp_path / "c", spec)
    config = StoreConfig(cache_dir=str(tmp_path / "c"), capacity="64MiB")
    with KVStore(config, spec) as store:
        victim = store.index.locate([keys[4]])[0][0]
        path = store.dir.chunk_path(store.namespace, victim)
        with open(path, "r+b") as handle:  # the JSON header's first byte
            handle.seek(8)
            handle.write(b"!")
        victim_keys = {k for k in keys if store.index.locate([k])[0][0] == victim}
        assert len(victim_keys) == 3
        ok = store.read(keys, empty_blocks(spec, len(keys)))
        assert {k for k, hit in zip(keys, ok, strict=True) if not hit} == victim_keys
        assert store.stats().counters["read_errors"] == 1
        assert store.stats().counters["quarantined_chunks"] == 1
