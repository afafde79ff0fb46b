"""The index's removal log (KV events, docs/decisions/0066): a reader that
follows it from its position learns every key that left the index, once per
departure, whatever was committed, evicted, compacted or removed (a key a
commit evicts and takes back in one transaction never left);
a reader that fell behind the log's bound is told it missed entries. Several
processes share it: one process's evictions are read by another."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from npukv_store.store import index as index_module
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord

NS = b"n" * 16
SIZE = 100
CHAIN = [bytes([9, i]) * 8 for i in range(30)]


def present(index: Index) -> set[bytes]:
    return {bytes(key) for key, _, _ in index.iter_keys()}


class RemovalLogMachine(RuleBasedStateMachine):
    """Oracle: the keys db before and after each operation; what left it is
    what the log must add."""

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="npukv-removed-")
        self.index = Index(self.root, map_size=1 << 24, sync=False)
        self.next_id, self.clock = 1, 1
        self.position = self.index.removed_position()
        self.expected: list[bytes] = []  # departures the reader has not read

    def teardown(self) -> None:
        self.index.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _did(self, action) -> None:
        before = present(self.index)
        action()
        self.expected += sorted(before - present(self.index))

    def _record(self, keys: list[bytes]) -> ChunkRecord:
        self.next_id += 1
        self.clock += 1
        chunk_id = (self.next_id * 2654435761) % (1 << 40) + 1
        return ChunkRecord.new(chunk_id, NS, keys, SIZE * len(keys), self.clock)

    @rule(start=st.integers(0, 29), rows=st.integers(1, 6),
          capacity=st.sampled_from([1 << 40, 1500, 700]))  # fmt: skip
    def commit(self, start, rows, capacity):
        record = self._record(CHAIN[start : start + rows])
        self._did(
            lambda: self.index.commit_chunk(record, capacity_bytes=capacity, grace_ns=0)
        )

    @rule(excess=st.integers(1, 1200))
    def evict(self, excess):
        self._did(lambda: self.index.evict(excess, young_after_ns=self.clock))

    @rule(pick=st.integers(0, 10**6))
    def remove_one(self, pick):
        records = list(self.index.iter_chunks())
        if records:
            chunk = records[pick % len(records)].chunk_id
            self._did(lambda: self.index.remove_chunks([chunk]))

    @rule(pick=st.integers(0, 10**6))
    def compact_one(self, pick):
        """A rewrite moves keys to a new chunk: nothing leaves the index."""
        records = list(self.index.iter_chunks())
        if not records:
            return
        old = records[pick % len(records)]
        homes = {k: (c, r) for k, c, r in self.index.iter_keys() if c == old.chunk_id}
        keys = sorted(homes)
        if not keys:
            return
        new = self._record(keys)
        new = ChunkRecord.new(new.chunk_id, NS, keys, SIZE * len(keys) - 1, self.clock)
        sources = [homes[k] for k in keys]
        self._did(lambda: self.index.replace_chunks(new, sources, [old.chunk_id]))

    @rule(limit=st.integers(1, 5))
    def read(self, limit):
        got = self.index.removed_since(self.position, limit=limit)
        assert not got.gap
        unread = Counter(self.expected)
        assert not Counter(got.keys) - unread  # nothing that did not leave
        for key in got.keys:
            self.expected.remove(key)
        assert got.position >= self.position
        self.position = got.position

    @invariant()
    def everything_is_readable(self):
        got = self.index.removed_since(self.position, limit=1 << 20)
        assert not got.gap
        assert sorted(got.keys) == sorted(self.expected)


RemovalLogMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
test_the_removal_log_lists_every_departure_once = RemovalLogMachine.TestCase


def test_a_reader_behind_the_bound_is_told_of_the_gap(tmp_path, monkeypatch):
    monkeypatch.setattr(index_module, "REMOVED_LOG_ENTRIES", 4)
    index = Index(str(tmp_path), map_size=1 << 24, sync=False)
    position = index.removed_position()
    for i in range(6):  # six chunks committed, then removed: six entries
        record = ChunkRecord.new(i + 1, NS, [CHAIN[i]], SIZE, i + 1)
        index.commit_chunk(record, capacity_bytes=1 << 40, grace_ns=0)
        index.remove_chunks([i + 1])
    got = index.removed_since(position)
    assert got.gap
    assert got.keys == CHAIN[2:6]  # the 4 entries kept
    assert not index.removed_since(got.position).gap
    assert index.removed_since(got.position).keys == []
    assert index.removed_since(got.position + 5).gap  # a rebuilt, shorter log
    index.close()


def _evict_all(root: str) -> None:
    index = Index(root, map_size=1 << 24, sync=False)
    index.evict(1 << 40, young_after_ns=1 << 62)
    index.close()


def test_another_process_reads_the_evictions(tmp_path):
    root = str(tmp_path)
    index = Index(root, map_size=1 << 24, sync=False)
    for i in range(3):
        record = ChunkRecord.new(i + 1, NS, CHAIN[i * 4 : i * 4 + 4], SIZE, i + 1)
        index.commit_chunk(record, capacity_bytes=1 << 40, grace_ns=0)
    position = index.removed_position()
    index.close()  # LMDB: one environment per process; the child opens its own
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=_evict_all, args=(root,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    index = Index(root, map_size=1 << 24, sync=False)
    got = index.removed_since(position)
    assert not got.gap
    assert sorted(got.keys) == sorted(CHAIN[:12])
    index.close()


def _remove_one_by_one(root: str, ready: str) -> None:
    """Child: unpublish every chunk, one transaction each, until killed."""
    index = Index(root, map_size=1 << 24, sync=True)
    for n, record in enumerate(list(index.iter_chunks())):
        index.remove_chunks([record.chunk_id])
        if n == 0:  # the parent's clock starts at the first removal
            open(ready, "w").close()
    index.close()


@pytest.mark.parametrize("delay_ms", [5, 20, 60])
def test_a_kill_9_mid_removal_leaves_the_log_equal_to_the_departures(
    tmp_path, delay_ms
):
    """SIGKILL a process that removes chunks one transaction at a time: the
    keys the log lists are exactly the keys gone from the index, not one
    more or less (the log is written in the removing transaction)."""
    root = str(tmp_path / "index")
    os.makedirs(root)
    keys = [bytes([3, i % 256, i // 256]) * 5 + b"\x01" for i in range(12000)]
    index = Index(root, map_size=1 << 24, sync=False)
    for i in range(0, len(keys), 6):
        record = ChunkRecord.new(i + 1, NS, keys[i : i + 6], SIZE, i + 1)
        index.commit_chunk(record, capacity_bytes=1 << 40, grace_ns=0)
    position = index.removed_position()
    index.close()
    ready = str(tmp_path / "ready")
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=_remove_one_by_one, args=(root, ready))
    child.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay_ms / 1000)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    index = Index(root, map_size=1 << 24, sync=False)
    got = index.removed_since(position, limit=1 << 20)
    gone = set(keys) - present(index)
    index.close()
    assert not got.gap
    assert sorted(got.keys) == sorted(gone)
    assert 0 < len(gone) < len(keys), "the kill should land mid-way: tune delays"
