"""The index's chunk-at-a-time lookups (Index.locate / lookup_prefix confirm a
chain's keys against chunk records, docs/decisions/0060) give exactly the
answer of one keys-db lookup per key, whatever was committed, evicted,
compacted or touched before."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord

NS = b"n" * 16
SIZE = 100
# A chain of 40 keys; chunks take slices of it (so chains split across chunks
# and overlap: duplicates claimed by another chunk first).
CHAIN = [bytes([7, i]) * 8 for i in range(40)]
FOREIGN = b"\xee" * 16


def per_key(index: Index, keys: list[bytes]) -> list[tuple[int, int] | None]:
    """The oracle: each key's home read from the keys db alone."""
    homes = {key: (chunk_id, row) for key, chunk_id, row in index.iter_keys()}
    return [homes.get(bytes(k)) for k in keys]


def prefix_of(locations: list[tuple[int, int] | None]) -> int:
    return next((i for i, loc in enumerate(locations) if loc is None), len(locations))


class ChainLookupMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="npukv-chain-")
        self.index = Index(self.root, map_size=1 << 24, sync=False)
        self.next_id = 1
        self.clock = 1

    def teardown(self) -> None:
        self.index.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _record(self, keys: list[bytes]) -> ChunkRecord:
        self.next_id += 1
        self.clock += 1
        # ids out of order, as the store's random ones are
        chunk_id = (self.next_id * 2654435761) % (1 << 40) + 1
        return ChunkRecord.new(chunk_id, NS, keys, SIZE * len(keys), self.clock)

    @rule(
        start=st.integers(0, 39),
        rows=st.integers(1, 9),
        order=st.sampled_from(["chain", "reversed", "swap", "dup"]),
        capacity=st.sampled_from([1 << 40, 1 << 40, 2000, 900]),
    )
    def commit(self, start, rows, order, capacity):
        keys = CHAIN[start : start + rows]
        if order == "reversed":
            keys = keys[::-1]
        elif order == "swap" and len(keys) > 1:
            keys[0], keys[-1] = keys[-1], keys[0]
        elif order == "dup":
            keys = keys + keys[:1]  # a key twice in one chunk: its second row is dead
        self.index.commit_chunk(self._record(keys), capacity_bytes=capacity, grace_ns=0)

    @rule(excess=st.integers(1, 1500))
    def evict(self, excess):
        self.index.evict(excess, young_after_ns=self.clock)

    @rule(pick=st.integers(0, 10**6))
    def remove_one(self, pick):
        records = list(self.index.iter_chunks())
        if records:
            self.index.remove_chunks([records[pick % len(records)].chunk_id])

    @rule(pick=st.integers(0, 10**6), keep_source=st.booleans(), part=st.booleans())
    def compact(self, pick, keep_source, part):
        """Rewrite one chunk's live rows (``part``: but the first) into a new
        chunk; ``keep_source`` leaves the source published and replaces
        another chunk instead (replace_chunks must then lower the source's
        live count and unlist its moved rows)."""
        records = list(self.index.iter_chunks())
        if not records:
            return
        old = records[pick % len(records)]
        homes = self.index.locate(list(old.keys))
        live = [
            (row, key)
            for row, (key, home) in enumerate(zip(old.keys, homes, strict=True))
            if home == (old.chunk_id, row)
        ]
        if part:  # a rewrite of some rows only (row 0 stays behind)
            live = live[1:]
        if not live:
            return
        new = self._record([key for _, key in live])
        new = ChunkRecord.new(new.chunk_id, NS, new.keys, 1, new.created_ns)
        sources = [(old.chunk_id, row) for row, _ in live]
        others = [r.chunk_id for r in records if r.chunk_id != old.chunk_id]
        old_ids = others[:1] if keep_source else [old.chunk_id]
        self.index.replace_chunks(new, sources, old_ids)

    @rule(pick=st.integers(0, 10**6))
    def touch(self, pick):
        records = list(self.index.iter_chunks())
        if records:
            chunk_id = records[pick % len(records)].chunk_id
            self.clock += 1
            self.index.touch([chunk_id.to_bytes(8, "little")], self.clock)

    @invariant()
    def live_counts_are_true(self):
        homes = {key: loc for key, *loc in self.index.iter_keys()}
        for record in self.index.iter_chunks():
            home_rows = sum(
                homes.get(key) == [record.chunk_id, row]
                for row, key in enumerate(record.keys)
            )
            assert record.live_rows == home_rows, record

    @invariant()
    def a_listing_row_zero_is_a_whole_chunks(self):
        records = {r.chunk_id: r for r in self.index.iter_chunks()}
        with self.index._env.begin(db=self.index._keys) as txn:
            for key, value in txn.cursor():
                if len(value) > 12:
                    record = records[int.from_bytes(value[:8], "little")]
                    assert record.live_rows == record.num_rows
                    assert (bytes(key), value[8:12]) == (record.keys[0], bytes(4))
                    assert value[12:] == b"".join(record.keys[1:])

    @invariant()
    def chunk_walk_equals_per_key(self):
        records = list(self.index.iter_chunks())
        queries = [CHAIN, CHAIN[::-1], CHAIN[5:30], CHAIN[17:], CHAIN[:3]]
        queries += [list(r.keys) for r in records]
        queries += [list(r.keys)[::-1] + CHAIN[:4] for r in records[:3]]
        mixed = CHAIN[:6] + [FOREIGN] + CHAIN[6:12] + [CHAIN[7][:15]] + CHAIN[12:20]
        queries += [mixed, [CHAIN[3], CHAIN[3], CHAIN[4]], []]
        for keys in queries:
            expected = per_key(self.index, keys)
            assert self.index.locate(keys) == expected, keys
            assert self.index.lookup_prefix(keys) == prefix_of(expected), keys


TestChainLookup = ChainLookupMachine.TestCase
TestChainLookup.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)


def test_a_truncated_key_misses_even_where_a_record_holds_its_bytes(tmp_path):
    index = Index(str(tmp_path), map_size=1 << 24, sync=False)
    try:
        record = ChunkRecord.new(9, NS, CHAIN[:4], SIZE, 1)
        index.commit_chunk(record, capacity_bytes=1 << 40, grace_ns=0)
        assert index.lookup_prefix(CHAIN[:4]) == 4
        assert index.lookup_prefix([CHAIN[0], CHAIN[1][:15]]) == 1
        assert index.locate([CHAIN[0], CHAIN[1] + b"x"]) == [(9, 0), None]
        # pieces whose bytes run on as the stored keys do, 16 bytes on average
        pieces = [CHAIN[0], CHAIN[1][:15], CHAIN[1][15:] + CHAIN[2]]
        assert index.lookup_prefix(pieces) == 1
        assert index.locate(pieces) == [(9, 0), None, None]
    finally:
        index.close()
