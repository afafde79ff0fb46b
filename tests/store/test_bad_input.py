"""Bad input, end to end: each case is one clear error or a miss, never a crash
and never wrong bytes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from npukv_store import (
    BadMagic,
    ConfigError,
    KVStore,
    StoreConfig,
    VersionMismatch,
)
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec
from tests.support.chunks import only_chunk

pytestmark = pytest.mark.integration


@pytest.fixture
def filled(tmp_path):
    """A directory holding one chunk of 4 blocks; returns (config, keys)."""
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, tiny_spec()) as store:
        keys = store.keys_for(range(64))
        store.put(keys, block_tensors(store.spec, keys))
    return config, keys


def test_foreign_format_version(filled):
    config, _ = filled
    marker = os.path.join(config.cache_dir, "NPUKV_STORE")
    with open(marker) as handle:
        body = json.load(handle)
    body["format_version"] = 99
    with open(marker, "w") as handle:
        json.dump(body, handle)
    with pytest.raises(VersionMismatch, match="format version 99, expected 2"):
        KVStore(config, tiny_spec())
    with open(marker, "w") as handle:
        handle.write("not json")
    with pytest.raises(BadMagic, match="expected an npukv marker"):
        KVStore(config, tiny_spec())


def test_chunk_of_another_namespace_is_a_miss(filled, tmp_path):
    config, keys = filled
    other_spec = tiny_spec(model="other-model")
    with KVStore(config, other_spec) as other:
        other_keys = other.keys_for(range(64))
        other.put(other_keys, block_tensors(other_spec, other_keys))
        mine = only_chunk(config.cache_dir, KVStore(config, tiny_spec()).namespace)
        theirs = only_chunk(config.cache_dir, other.namespace)
    os.replace(theirs, mine)  # the other model's bytes under my chunk's name
    with KVStore(config, tiny_spec()) as store:
        assert store.lookup(keys) == 4  # the index still says stored...
        out = empty_blocks(store.spec, 4)
        assert any("namespace" in p for p in store.check())
        assert store.read(keys, out) == [False] * 4  # ...but reading refuses
        counters = store.stats().counters
        assert counters["read_errors"] == 1
        # and quarantines the chunk: unpublished, file gone, saved again later
        assert counters["quarantined_chunks"] == 1
        assert store.lookup(keys) == 0
        assert not os.path.exists(mine)
        # (the other model's chunk is "indexed but missing": the test moved it)
        assert [p for p in store.check() if store.namespace in p] == []


@pytest.mark.parametrize("damage", ["truncate_data", "truncate_header", "flip_data"])
def test_truncated_or_corrupt_chunk_is_a_miss(filled, damage):
    config, keys = filled
    with KVStore(config, tiny_spec()) as store:
        path = only_chunk(config.cache_dir, store.namespace)
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        if damage == "truncate_data":
            handle.truncate(size - 100)
        elif damage == "truncate_header":
            handle.truncate(100)
        else:
            handle.seek(4096 + 3 * 1024 + 7)  # inside layer 1 of block 0
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0x40]))
    with KVStore(config, tiny_spec()) as store:
        out = empty_blocks(store.spec, 4)
        ok = store.read(keys, out)
        expected = block_tensors(store.spec, keys)
        if damage == "flip_data":
            assert ok.count(False) == 1
            assert store.stats().counters["checksum_errors"]
            # the damaged file was cached: read and verified in one pass
            assert store.stats().counters["cached_read_bytes"] > 0
        else:
            assert ok == [False] * 4
        for i, hit in enumerate(ok):
            for name, array in expected.items():
                if hit:
                    np.testing.assert_array_equal(out[name][i], array[i])
        # the whole chunk is suspect: unpublished and removed, so its blocks
        # are recomputed and saved again rather than missed forever
        assert store.stats().counters["quarantined_chunks"] == 1
        assert store.lookup(keys) == 0
        assert not os.path.exists(path)
        assert store.check(verify_data=True) == []
        store.put(keys, expected)
        assert store.read(keys, out) == [True] * 4


def test_chunk_cut_short_after_its_header_was_cached_is_a_miss(filled):
    """The reader caches headers; a file cut short later (by something else)
    makes the read of its last layer short: the run of blocks that read
    covers is a miss (here all four: one run), nothing wrong is served, and
    the chunk is quarantined."""
    config, keys = filled
    with KVStore(config, tiny_spec()) as store:
        out = empty_blocks(store.spec, 4)
        assert store.read(keys, out) == [True] * 4  # header now cached
        path = only_chunk(config.cache_dir, store.namespace)
        layer = store.spec.layers[-1]
        table = 8 * 4 * len(store.spec.layers)
        cut = os.path.getsize(path) - table - layer.parts[-1].row_bytes // 2
        os.truncate(path, cut)  # inside the last block's last part
        before = store.stats().counters
        ok = store.read(keys, out)
        counters = store.stats().counters
        assert ok == [False] * 4
        assert counters["read_errors"] > before["read_errors"]
        assert counters["cached_read_bytes"] > before["cached_read_bytes"]
        assert counters["quarantined_chunks"] == before["quarantined_chunks"] + 1
        assert store.lookup(keys) == 0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"capcity": "1GiB"}, "unknown config key"),
        ({"capacity": "-1GiB"}, "capacity: found '-1GiB'"),
        ({"capacity": "much"}, "capacity: found 'much'"),
    ],
)
def test_bad_config_stops_before_touching_disk(tmp_path, extra, match):
    root = tmp_path / "never"
    with pytest.raises(ConfigError, match=match):
        KVStore(
            StoreConfig.from_extra_config({"cache_dir": str(root), **extra}, env={}),
            tiny_spec(),
        )
    assert not root.exists()
