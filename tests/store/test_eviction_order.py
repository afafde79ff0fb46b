"""Eviction never strands a child (docs/decisions/0070): a chunk's LRU time
stays below that of the chunk holding its parent block, through saves with a
parent, lookups (ordered touches), reads and evicting commits, so no stored
block's parent block is ever gone (one tenant, no pins)."""

from __future__ import annotations

import secrets

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from npukv_store import KVStore, StoreConfig
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec

DEPTH, BRANCHES = 4, 3
SPEC = tiny_spec()
#: every save written (admission, docs/decisions/0069, is not under test)
WRITE_ALL = (
    {"admission": "all"} if "admission" in StoreConfig.__dataclass_fields__ else {}
)


def tokens_of(path: tuple[int, ...]) -> list[int]:
    return [t for sym in path for t in [sym + 1] * SPEC.block_size]


def save(store: KVStore, keys: list[bytes], split: int) -> None:
    """The connector's way: look the chain up, save the rest after the hit,
    each chunk with the key before it as its parent."""
    hit = store.lookup(keys)
    for start in range(hit, len(keys), split):
        piece = keys[start : start + split]
        store.put(
            piece,
            block_tensors(store.spec, piece),
            parent=keys[start - 1] if start else None,
        )


def stranded(store: KVStore, parent_of: dict[bytes, bytes | None]) -> list[bytes]:
    stored = {key for key, _, _ in store.index.iter_keys()}
    return [
        k for k in stored if parent_of[k] is not None and parent_of[k] not in stored
    ]


paths = st.lists(st.integers(0, BRANCHES - 1), min_size=1, max_size=DEPTH).map(tuple)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("save"), paths, st.integers(1, 3)),
        st.tuples(st.just("lookup"), paths, st.just(0)),
        st.tuples(st.just("read"), paths, st.just(0)),
        st.tuples(st.just("flush"), st.just(()), st.just(0)),
    ),
    min_size=1,
    max_size=30,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=ops, grace=st.sampled_from([0.0, 5.0]))
# a parent refused (older than all else) and its child saved after it
@example(
    steps=[
        ("save", (0,), 1),
        ("save", (1, 0, 0, 0), 1),
        ("lookup", (1, 0, 0, 0), 0),
        ("save", (0, 0), 1),
    ],
    grace=0.0,
)
def test_no_stored_block_outlives_its_parent(tmp_path_factory, steps, grace):
    root = tmp_path_factory.mktemp("order")
    one_block = SPEC.block_bytes + 4096 // 2  # a chunk's header shared by rows
    config = StoreConfig(
        cache_dir=str(root), capacity=6 * one_block, evict_grace_s=grace,
        fsync="never",
        **WRITE_ALL,
    )  # fmt: skip
    with KVStore(config, SPEC) as store:
        parent_of: dict[bytes, bytes | None] = {}
        for op, path, split in steps:
            keys = store.keys_for(tokens_of(path)) if path else []
            for i, key in enumerate(keys):
                parent_of[key] = keys[i - 1] if i else None
            if op == "save":
                save(store, keys, split)
            elif op == "lookup":
                store.lookup(keys)
            elif op == "read":
                hit = store.lookup(keys)
                if not hit:
                    continue
                out = empty_blocks(store.spec, hit)
                ok = store.read(keys[:hit], out)
                want = block_tensors(store.spec, keys[:hit])
                for name, rows in want.items():
                    for i in np.flatnonzero(ok):
                        np.testing.assert_array_equal(out[name][i], rows[i])
            else:
                store.flush_touches()
            assert stranded(store, parent_of) == [], (op, path)
        assert store.check() == []


def test_a_hit_keeps_the_parent_newer_than_the_child(tmp_path, monkeypatch):
    """The old bug: a hit touched the parent's chunk and the child's with one
    timestamp, and chunk ids (random) broke the tie: here the parent's id is
    the smaller one, so eviction took the parent and stranded the child."""
    ids = iter([1, 2, 3, 4, 5, 6])
    monkeypatch.setattr(secrets, "randbits", lambda bits: next(ids) - 1)
    config = StoreConfig(
        cache_dir=str(tmp_path / "c"), capacity=30000, evict_grace_s=0,
        fsync="never",
        **WRITE_ALL,
    )  # fmt: skip
    with KVStore(config, SPEC) as store:
        chain = store.keys_for(tokens_of((0, 1, 2, 0)))
        store.put(chain[:2], block_tensors(SPEC, chain[:2]))  # parent: chunk 1
        store.put(chain[2:], block_tensors(SPEC, chain[2:]), parent=chain[1])
        assert store.lookup(chain) == 4
        store.flush_touches()  # both chunks touched by one flush
        other = store.keys_for(tokens_of((2, 2, 2)))
        result = store.put(other, block_tensors(SPEC, other))
        assert result.stored == 3
        assert store.stats().counters["evicted_chunks"] == 1
        assert store.lookup(chain) == 2  # the child went, its parent stayed
        assert store.index.locate(chain[2:]) == [None, None]


def test_a_save_goes_below_its_old_parent(tmp_path):
    """A child saved after an old, untouched parent is dated below it: the
    next eviction takes the child first, never the parent alone."""
    config = StoreConfig(
        cache_dir=str(tmp_path / "c"), capacity=1 << 20, evict_grace_s=0,
        fsync="never",
        **WRITE_ALL,
    )  # fmt: skip
    with KVStore(config, SPEC) as store:
        chain = store.keys_for(tokens_of((1, 1, 1)))
        store.put(chain[:1], block_tensors(SPEC, chain[:1]))
        store.put(chain[1:], block_tensors(SPEC, chain[1:]), parent=chain[0])
        (p, _), (c, _) = store.index.locate(chain[:2])
        parent, child = store.index.chunk(p), store.index.chunk(c)
        assert child.last_access_ns == parent.last_access_ns - 1
        assert not child.read_since_written  # dated at or before its write
        store.lookup(chain)
        store.flush_touches()
        parent, child = store.index.chunk(p), store.index.chunk(c)
        assert parent.last_access_ns > child.last_access_ns
        assert child.read_since_written


def test_compaction_takes_the_oldest_source_time(tmp_path):
    """replace_chunks dates the rewrite at its oldest source: still below
    every source's parent."""
    from npukv_store.store.index import Index
    from npukv_store.store.index_rows import ChunkRecord

    index = Index(str(tmp_path / "index"), map_size=1 << 24, sync=False)
    try:
        ns = bytes(16)
        keys = [bytes([i]) * 16 for i in range(4)]
        for n, (at, when) in enumerate([(0, 300), (2, 200)], start=1):
            record = ChunkRecord.new(n, ns, keys[at : at + 2], 100, when)
            index.commit_chunk(record, capacity_bytes=1 << 40)
        new = ChunkRecord.new(9, ns, keys, 150, 400)
        live, removed = index.replace_chunks(
            new, [(1, 0), (1, 1), (2, 0), (2, 1)], [1, 2]
        )
        assert live == 4
        assert len(removed) == 2
        assert index.chunk(9).last_access_ns == 200
    finally:
        index.close()
