"""Capacity per tenant and pinned keys in the index (docs/decisions/0067).

A tenant under its share never loses a block to another tenant's commit;
the ledger keeps each tenant's bytes; a pinned key's chunk is never evicted
and has no LRU entry; unpinning puts it back. A hypothesis state machine
drives commits, pins, unpins, touches and the maintenance job's eviction
against one index; two processes of two tenants then fill a directory
several times over; a kill -9 mid-transaction leaves every invariant.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from npukv_store import KVStore, StoreConfig
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord
from tests.support.blocks import block_tensors, tiny_spec

NS = b"n" * 16
TENANTS = [bytes([i + 1]) * 8 for i in range(3)]
CAPACITY = 2000
SHARES = {TENANTS[0]: 600, TENANTS[1]: 400}  # tenant 2 has none


def _records(index: Index) -> dict[int, ChunkRecord]:
    return {r.chunk_id: r for r in index.iter_chunks()}


def _usage(records: dict[int, ChunkRecord]) -> dict[bytes, int]:
    usage: dict[bytes, int] = {}
    for record in records.values():
        usage[record.tenant] = usage.get(record.tenant, 0) + record.size_bytes
    return usage


class TenantIndexMachine(RuleBasedStateMachine):
    """Oracle: the records before and after each operation."""

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="npukv-tenants-")
        self.index = Index(self.root, map_size=1 << 24, sync=False)
        self.next_id, self.clock, self.next_key = 1, 1, 1
        self.pins: dict[bytes, list[bytes]] = {}

    def teardown(self) -> None:
        self.index.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _keys(self, count: int) -> list[bytes]:
        self.next_key += count
        return [(self.next_key - i).to_bytes(16, "big") for i in range(count)]

    @rule(
        tenant=st.sampled_from(TENANTS),
        count=st.integers(1, 4),
        size=st.integers(50, 400),
        reuse=st.booleans(),
    )
    def commit(self, tenant: bytes, count: int, size: int, reuse: bool) -> None:
        keys = self._keys(count)
        if reuse and self.pins:  # a pinned prompt saved again, or for the first time
            keys = next(iter(self.pins.values()))[:count] + keys[1:]
        self.next_id += 1
        self.clock += 1
        record = ChunkRecord.new(self.next_id, NS, keys, size, self.clock, tenant)
        before = _records(self.index)
        usage = _usage(before)
        result = self.index.commit_chunk(
            record, capacity_bytes=CAPACITY, grace_ns=0, shares=SHARES
        )
        for victim in result.victims:
            if victim.tenant != tenant:  # another's commit took it: it was over
                assert usage[victim.tenant] > SHARES.get(victim.tenant, 0)
            usage[victim.tenant] -= victim.size_bytes
            assert not victim.pinned

    @rule(count=st.integers(1, 6), stored=st.booleans())
    def pin(self, count: int, stored: bool) -> None:
        records = list(_records(self.index).values())
        keys = self._keys(count)
        if stored and records:  # pin keys already stored (and some not yet)
            keys = list(records[len(records) // 2].keys[:count]) + keys[1:]
        pin_id = os.urandom(8)
        self.index.add_pin(pin_id, b"{}")
        assert self.index.pin_keys(pin_id, keys) is not None
        self.pins[pin_id] = keys

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        pin_id = data.draw(st.sampled_from(sorted(self.pins)))
        assert self.index.unpin(pin_id)
        del self.pins[pin_id]
        assert self.index.pin_keys(pin_id, [b"x" * 16]) is None  # gone: refused

    @rule()
    def touch_all(self) -> None:
        self.clock += 1
        ids = [r.chunk_id.to_bytes(8, "little") for r in self.index.iter_chunks()]
        self.index.touch(ids, self.clock)

    @rule(excess=st.integers(1, 3000))
    def maintenance_evicts(self, excess: int) -> None:
        usage = _usage(_records(self.index))
        for victim in self.index.evict(excess, young_after_ns=self.clock):
            assert usage[victim.tenant] > SHARES.get(victim.tenant, 0)
            usage[victim.tenant] -= victim.size_bytes
            assert not victim.pinned

    @invariant()
    def ledger_lru_and_pins_agree_with_the_records(self) -> None:
        records = _records(self.index)
        ledger, shares = self.index.tenants()
        assert ledger == {t: n for t, n in _usage(records).items() if n}
        total, _, _ = self.index.totals()
        assert total == sum(r.size_bytes for r in records.values()) <= CAPACITY
        if records:
            assert shares == SHARES
        lru = {cid for _, cid in self.index.iter_lru()}
        assert lru == {cid for cid, r in records.items() if not r.pinned}
        pinned = {key for keys in self.pins.values() for key in keys}
        assert self.index.pinned_key_set() == pinned
        homes = {key: cid for key, cid, _ in self.index.iter_keys()}
        holding = {homes[key] for key in pinned if key in homes}
        assert {cid for cid, r in records.items() if r.pinned} == holding


TenantIndexMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
test_tenant_index = TenantIndexMachine.TestCase


def test_a_pinned_chunk_survives_a_directory_refilled_and_leaves_once_unpinned(
    tmp_path,
):
    index = Index(str(tmp_path), map_size=1 << 24, sync=False)
    pinned = [bytes([7, i]) * 8 for i in range(3)]
    index.add_pin(b"p" * 8, b"{}")
    index.pin_keys(b"p" * 8, pinned)  # before any server stored them
    index.commit_chunk(
        ChunkRecord.new(1, NS, pinned, 300, 1), capacity_bytes=1000, grace_ns=0
    )
    for i in range(2, 40):  # the directory filled ten times over
        keys = [bytes([8, i]) * 8]
        index.commit_chunk(
            ChunkRecord.new(i, NS, keys, 100, i), capacity_bytes=1000, grace_ns=0
        )
    assert index.lookup_prefix(pinned) == 3
    assert index.chunk(1).pinned
    # Pinned bytes count: a commit that needs them is refused, not made room for.
    big = ChunkRecord.new(99, NS, [b"b" * 16], 800, 99)
    assert index.commit_chunk(big, capacity_bytes=1000, grace_ns=0).rejected
    index.unpin(b"p" * 8)
    assert not index.chunk(1).pinned
    index.commit_chunk(
        ChunkRecord.new(100, NS, [b"c" * 16], 950, 100), capacity_bytes=1000,
        grace_ns=0,
    )  # fmt: skip
    assert index.lookup_prefix(pinned) == 0
    index.close()


# -- several processes, two tenants -----------------------------------------------


def _config(root: str, capacity: int) -> StoreConfig:
    return StoreConfig(
        cache_dir=root, capacity=capacity, evict_grace_s=0, fsync="never",
        tenant_shares={"tenant-a": 0.4, "tenant-b": 0.25},
    )  # fmt: skip


def _fill(root: str, capacity: int, salt: str | None, chunks: int, out) -> None:
    """Save ``chunks`` chunks of 4 fresh blocks as ``salt``'s tenant."""
    spec = tiny_spec()
    with KVStore(_config(root, capacity), spec) as store:
        tenant = store.tenant(salt)
        written = []
        for _ in range(chunks):
            keys = [os.urandom(16) for _ in range(4)]
            store.put(keys, block_tensors(spec, keys), tenant=tenant)
            written += keys
    out.put((salt, b"".join(written)))


def _chunk_bytes(root: str) -> int:
    spec = tiny_spec()
    with KVStore(_config(root, 1 << 30), spec) as store:
        keys = [os.urandom(16) for _ in range(4)]
        store.put(keys, block_tensors(spec, keys))
        return store.stats().total_bytes


@pytest.mark.integration
def test_two_tenants_and_the_rest_fill_a_directory_from_three_processes(tmp_path):
    chunk = _chunk_bytes(str(tmp_path / "probe"))
    capacity = 40 * chunk
    root = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    plan = [
        ("tenant-a", 12),  # 30% of capacity: under its 40% share
        ("tenant-b", 120),  # three times the directory
        (None, 120),  # the default tenant, without a share
    ]
    workers = [
        ctx.Process(target=_fill, args=(root, capacity, salt, n, out))
        for salt, n in plan
    ]
    for worker in workers:
        worker.start()
    written = dict(out.get(timeout=300) for _ in workers)
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    spec = tiny_spec()
    with KVStore(_config(root, capacity), spec) as store:
        blob = written["tenant-a"]
        keys_a = [blob[i : i + 16] for i in range(0, len(blob), 16)]
        assert all(store.present(keys_a)), "tenant-a is under its share"
        ledger, shares = store.index.tenants()
        share_b = shares[store.tenant("tenant-b")]
        assert share_b == int(0.25 * capacity)
        # b wrote far more than its share: it keeps at least its share,
        # less one chunk (the default tenant, at share 0, goes first)
        assert ledger[store.tenant("tenant-b")] >= share_b - chunk
        assert sum(ledger.values()) <= capacity
        assert store.check() == []


def _pin_and_evict_forever(root: str, ready: str) -> None:
    """Pin, unpin and commit (evicting) in a loop until killed."""
    index = Index(os.path.join(root, "index"), map_size=1 << 24, sync=False)
    i = 0
    while True:
        i += 1
        pin_id = (i % 5).to_bytes(8, "big")
        keys = [bytes([i % 7, j]) * 8 for j in range(4)]
        if i % 3:
            index.add_pin(pin_id, b"{}")
            index.pin_keys(pin_id, keys)
        else:
            index.unpin(pin_id)
        record = ChunkRecord.new(i, NS, keys[i % 2 :], 100, i, TENANTS[i % 3])
        index.commit_chunk(record, capacity_bytes=1500, grace_ns=0, shares=SHARES)
        if i == 200:
            open(ready, "w").close()


@pytest.mark.integration
def test_a_kill_9_mid_pin_or_commit_leaves_every_invariant(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "index"))
    ready = os.path.join(root, "ready")
    child = multiprocessing.get_context("spawn").Process(
        target=_pin_and_evict_forever, args=(root, ready)
    )
    child.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    index = Index(os.path.join(root, "index"), map_size=1 << 24, sync=False)
    records = _records(index)
    ledger, _ = index.tenants()
    assert ledger == {t: n for t, n in _usage(records).items() if n}
    lru = {cid for _, cid in index.iter_lru()}
    assert lru == {cid for cid, r in records.items() if not r.pinned}
    pinned = index.pinned_key_set()
    homes = {key: cid for key, cid, _ in index.iter_keys()}
    assert {cid for cid, r in records.items() if r.pinned} == {
        homes[key] for key in pinned if key in homes
    }
    assert len(records) > 1
    index.close()


def test_a_rewrite_whose_source_was_pinned_since_its_plan_does_nothing(tmp_path):
    index = Index(str(tmp_path), map_size=1 << 24, sync=False)
    keys = [bytes([5, i]) * 8 for i in range(2)]
    for i, key in enumerate(keys):
        index.commit_chunk(
            ChunkRecord.new(i + 1, NS, [key], 100, i + 1), capacity_bytes=10**6,
            grace_ns=0,
        )  # fmt: skip
    index.add_pin(b"p" * 8, b"{}")
    index.pin_keys(b"p" * 8, keys[:1])  # after compaction planned chunks 1 and 2
    merged = ChunkRecord.new(9, NS, keys, 150, 1)
    assert index.replace_chunks(merged, [(1, 0), (2, 0)], [1, 2]) == (0, [])
    assert index.chunk(1).pinned
    assert index.chunk(9) is None
    index.close()
