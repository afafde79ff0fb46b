"""Admission's rules (npukv_store/store/admission.py) and their LMDB tables
(index_admission.py): properties over random inputs, and the LMDB table
against the in-memory one as its model."""

from __future__ import annotations

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.store import index_admission as table
from npukv_store.store.admission import (
    AdmissionTuning,
    MemoryKeys,
    Mode,
    Scores,
    Shadow,
    TokenBucket,
    admitted_run,
    choose_mode,
    ghost_capacity,
    sample_threshold,
    shadow_capacity,
    trim,
)

TUNING = AdmissionTuning()
keys_st = st.lists(st.integers(0, 40), max_size=30)


@given(keys_st, st.sets(st.integers(0, 40)), st.sampled_from(list(Mode)))
def test_admitted_run_is_a_leading_run_of_seen_keys(keys, seen, mode):
    run = admitted_run(mode, keys, seen.__contains__)
    assert 0 <= run <= len(keys)
    if mode is Mode.ALL:
        assert run == len(keys)
    elif mode is Mode.NONE:
        assert run == 0
    else:  # prefix-closed: every admitted key seen, and the next one not
        assert all(k in seen for k in keys[:run])
        assert run == len(keys) or keys[run] not in seen


def test_choose_mode_follows_policy_scores_and_budget():
    # Scores(hits all, hits second sight, asks, writes all, writes second sight)
    all_wins = Scores(20, 10, 100, 30, 5)  # 10 more hits for 25 more writes
    ss_wins = Scores(5, 9, 50, 40, 5)
    even = Scores(10, 10, 100, 50, 10)
    dear = Scores(12, 10, 100, 40, 10)  # 2 more hits for 30 more writes
    assert choose_mode("all", ss_wins, 1.0, TUNING) is Mode.ALL
    assert choose_mode("second_sight", all_wins, 1.0, TUNING) is Mode.SECOND_SIGHT
    assert choose_mode("auto", all_wins, 1.0, TUNING) is Mode.ALL
    assert choose_mode("auto", ss_wins, 1.0, TUNING) is Mode.SECOND_SIGHT
    # a tie, or hits that cost more writes than they are worth: second sight
    assert choose_mode("auto", even, 1.0, TUNING) is Mode.SECOND_SIGHT
    assert choose_mode("auto", dear, 1.0, TUNING) is Mode.SECOND_SIGHT
    assert choose_mode("auto", dear, 1.0, AdmissionTuning(margin=0.05)) is Mode.ALL
    # warming up (fewer asks than the shadow holds): write everything
    assert choose_mode("auto", ss_wins, 1.0, TUNING, warm_asks=51) is Mode.ALL
    assert choose_mode("auto", ss_wins, 1.0, TUNING, warm_asks=50) is Mode.SECOND_SIGHT
    # warm, and no hit in either shadow (a scan): write little
    assert choose_mode("auto", Scores(asks=9), 1.0, TUNING, 8) is Mode.SECOND_SIGHT
    # over budget, admission tightens whatever the policy
    assert choose_mode("all", all_wins, 0.4, TUNING) is Mode.SECOND_SIGHT
    assert choose_mode("all", all_wins, 0.0, TUNING) is Mode.NONE
    assert choose_mode("auto", all_wins, -1.0, TUNING) is Mode.NONE


@given(st.integers(1, 1 << 40))
def test_sampling_and_bounds_scale_with_capacity(blocks):
    rate = sample_threshold(blocks, TUNING) / (1 << 64)
    cap = shadow_capacity(blocks, TUNING)
    assert cap <= TUNING.shadow_blocks
    assert cap <= blocks
    assert rate == pytest.approx(min(1.0, TUNING.shadow_blocks / blocks), rel=1e-9)
    ghost = ghost_capacity(blocks, TUNING)
    assert min(64, TUNING.ghost_max) <= ghost <= TUNING.ghost_max


@given(st.lists(st.integers(0, 30), max_size=300), st.integers(1, 8))
def test_shadow_is_bounded_and_scores_no_more_hits_than_asks(asks, capacity):
    shadow = Shadow(MemoryKeys(), MemoryKeys(), MemoryKeys(), capacity, 2 * capacity,
                    AdmissionTuning(window=4.0))  # fmt: skip
    scores = Scores()
    for key in asks:
        shadow.ask(key, scores)
        assert len(shadow.every) <= capacity
        assert len(shadow.second) <= capacity
        assert len(shadow.ghost) <= 2 * capacity
        assert scores.hits_all <= scores.asks
        assert scores.hits_second_sight <= scores.asks
    assert scores.asks <= max(len(asks), 4.0 * capacity)


def test_shadow_scores_each_mode_as_its_policy_would():
    """One-use keys: write-all never hits, nor second sight. A key asked
    three times: write-all hits twice, second sight once (on its third).
    Write-all writes every first ask (3), second sight only the second (1)."""
    shadow = Shadow(MemoryKeys(), MemoryKeys(), MemoryKeys(), 4, 8, TUNING)
    scores = Scores()
    for key in (1, 7, 1, 8, 1):
        shadow.ask(key, scores)
    assert (scores.hits_all, scores.hits_second_sight, scores.asks) == (2, 1, 5)
    assert (scores.writes_all, scores.writes_second_sight) == (3, 1)


@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**12)), max_size=40))
def test_token_bucket_never_exceeds_its_size(events):
    rate, size = 1000.0, 5e6
    bucket = TokenBucket(size, 0)
    now = 0
    for spend, step_ns in events:
        now += step_ns
        bucket.spend(spend, now, rate, size)
        assert bucket.tokens <= size
        assert bucket.refilled(now, rate, size) <= size


# -- the LMDB tables against MemoryKeys -------------------------------------------

ops_st = st.lists(
    st.tuples(st.sampled_from(["push", "discard", "pop", "trim"]), st.integers(0, 12)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops_st)
def test_lmdb_keys_behave_as_memory_keys(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("adm")
    env = lmdb.open(str(path), max_dbs=2, map_size=1 << 24)
    db = env.open_db(b"admission")
    model = MemoryKeys()
    try:
        for op, key in ops:
            with env.begin(write=True) as txn:
                seq = table.SeqCounter(txn, db)
                real = table.LmdbKeys(txn, db, table.GHOST, seq)
                if op == "push":
                    real.push(key), model.push(key)
                elif op == "discard":
                    assert real.discard(key) == model.discard(key)
                elif op == "pop":
                    assert real.pop_oldest() == model.pop_oldest()
                else:
                    trim(real, key // 2), trim(model, key // 2)
                seq.write()
                assert len(real) == len(model)
                assert all((k in real) == (k in model) for k in range(13))
            with env.begin() as txn:
                assert table.check(txn, db) == []
    finally:
        env.close()


def test_check_reports_a_size_that_lies(tmp_path):
    """The consistency check can fail: a table whose size record is off."""
    env = lmdb.open(str(tmp_path), max_dbs=2, map_size=1 << 24)
    db = env.open_db(b"admission")
    with env.begin(write=True) as txn:
        seq = table.SeqCounter(txn, db)
        real = table.LmdbKeys(txn, db, table.GHOST, seq)
        real.push(1), real.push(2)
        txn.put(table.GHOST + b"#", table.U64.pack(3), db=db)
    with env.begin() as txn:
        assert table.check(txn, db) == ["table g: 2 members, 2 in order, size 3"]
    env.close()


def test_store_check_reports_inconsistent_admission_tables(tmp_path):
    """``npukv verify`` (KVStore.check) names a broken admission table."""
    from npukv_store import KVStore
    from npukv_store.config import StoreConfig
    from tests.support.blocks import block_tensors, tiny_spec

    config = StoreConfig(cache_dir=str(tmp_path / "c"), admission="second_sight")
    with KVStore(config, tiny_spec()) as store:
        keys = store.keys_for(range(16))
        store.put(keys, block_tensors(store.spec, keys))  # declined: in the ghost
        assert store.check() == []
        index = store.index
        with index._env.begin(write=True) as txn:
            txn.put(table.GHOST + b"#", table.U64.pack(5), db=index.admission_db)
        assert store.check() == ["admission: table g: 1 members, 1 in order, size 5"]


def test_a_lost_hit_is_a_block_declined_then_brought_again(tmp_path):
    """Blocks written (while auto warms up), evicted and brought again are
    not lost hits; blocks second sight declined and a save brings again
    are, once each."""
    from npukv_store import KVStore
    from npukv_store.config import StoreConfig
    from tests.support.blocks import block_tensors, tiny_spec

    root = str(tmp_path / "c")
    config = StoreConfig(cache_dir=root, capacity="24KiB", evict_grace_s=0)
    with KVStore(config, tiny_spec()) as store:
        first = store.keys_for(range(16))
        assert store.put(first, block_tensors(store.spec, first)).stored == 1
        for start in range(100, 700, 100):  # push it out
            keys = store.keys_for(range(start, start + 16))
            store.put(keys, block_tensors(store.spec, keys))
        assert store.lookup(first) == 0
        store.put(first, block_tensors(store.spec, first))
        assert store.counters.snapshot()["lost_hit_blocks"] == 0
    config = StoreConfig(cache_dir=root, capacity="24KiB", admission="second_sight")
    with KVStore(config, tiny_spec()) as store:
        fresh = store.keys_for(range(900, 916))
        assert store.put(fresh, block_tensors(store.spec, fresh)).stored == 0
        assert store.put(fresh, block_tensors(store.spec, fresh)).stored == 1
        assert store.counters.snapshot()["lost_hit_blocks"] == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=5), max_size=12))
def test_the_ask_log_keeps_order_and_its_bound(tmp_path_factory, flushes):
    """Every process's shadow reads the same asks in the order they were
    logged, from where it left off; the log keeps its newest entries."""
    path = tmp_path_factory.mktemp("asks")
    env = lmdb.open(str(path), max_dbs=2, map_size=1 << 24)
    db = env.open_db(b"admission")
    bound, position, seen, logged = 4, 0, [], []
    try:
        for i, prefixes in enumerate(flushes):
            with env.begin(write=True) as txn:
                seq = table.SeqCounter(txn, db)
                old = table.ASK_LOG_ENTRIES
                table.ASK_LOG_ENTRIES = bound
                try:
                    table.append_asks(txn, db, prefixes, seq)
                finally:
                    table.ASK_LOG_ENTRIES = old
                seq.write()
                if prefixes:
                    logged.append(prefixes)
                assert table.table_sizes(txn, db)["ask_log"] == min(len(logged), bound)
                if i % 3 == 2:  # a reader that reads every third flush
                    new, position = table.asks_since(txn, db, position)
                    seen.extend(new)
        with env.begin() as txn:
            new, position = table.asks_since(txn, db, position)
            seen.extend(new)
        # read every third flush, with four kept: nothing lost, in order, once
        assert seen == [p for batch in logged for p in batch]
    finally:
        env.close()
