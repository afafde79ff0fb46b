"""Fixtures of the read-path tests."""

from __future__ import annotations

import pytest

from npukv_store import KVStore, StoreConfig
from tests.support.blocks import block_tensors
from tests.support.chunks import BLOCKS, aligned_spec


@pytest.fixture
def stored(tmp_path):
    spec = aligned_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "cache"), capacity="64MiB")
    keys = [bytes([i, 7]) * 8 for i in range(BLOCKS)]
    with KVStore(config, spec) as store:
        assert store.put(keys, block_tensors(spec, keys)).stored == BLOCKS
    return config, spec, keys
