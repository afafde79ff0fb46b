"""The shared index, driven by hypothesis: random puts, lookups, reads, touches
and evictions against a model of which keys may be stored, with check() after
every step."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from npukv_store import KVStore, StoreConfig
from npukv_store.hashing import chain_hashes
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec

SPEC = tiny_spec(num_layers=2)
# 24 chained keys
UNIVERSE = chain_hashes(range(16 * 24), 16, b"universe", key=b"k" * 32)
CHUNK_BYTES = 4096 + 2 * SPEC.block_bytes + 2 * 2 * 8  # a put of two blocks


class IndexMachine(RuleBasedStateMachine):
    """Model: ``ever`` = keys whose put stored them. A key the store reports
    present must be in ``ever`` and read back exactly; capacity always holds."""

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="npukv-index-")
        self.config = StoreConfig(
            cache_dir=self.root, capacity=4 * CHUNK_BYTES, evict_grace_s=0
        )
        self.store = KVStore(self.config, SPEC)
        self.ever: set[bytes] = set()

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(start=st.integers(0, 22), count=st.sampled_from([1, 2, 2, 3]))
    def put(self, start, count):
        keys = UNIVERSE[start : start + count]
        result = self.store.put(keys, block_tensors(SPEC, keys))
        assert result.stored + result.skipped + result.rejected == len(keys)
        if result.stored:
            assert self.store.lookup(keys) == len(keys) or result.skipped
            self.ever.update(keys)

    @rule(start=st.integers(0, 23), count=st.integers(1, 24))
    def lookup_matches_read(self, start, count):
        keys = UNIVERSE[start : start + count]
        hits = self.store.lookup(keys)
        out = empty_blocks(SPEC, len(keys))
        ok = self.store.read(keys, out)
        assert all(ok[:hits]), "a key counted by lookup must be readable"
        expected = block_tensors(SPEC, keys)
        for i, hit in enumerate(ok):
            if hit:
                assert keys[i] in self.ever
                for name, array in expected.items():
                    np.testing.assert_array_equal(out[name][i], array[i])

    @rule()
    def flush_touches(self):
        self.store.flush_touches()

    @rule()
    def reopen(self):
        self.store.close()
        self.store = KVStore(self.config, SPEC)

    @invariant()
    def invariants_hold(self):
        assert self.store.stats().total_bytes <= self.config.capacity
        assert self.store.check() == []


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None
)
