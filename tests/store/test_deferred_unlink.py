"""Saves under a full, busy directory (docs/decisions/0070): a commit takes its
victims in LRU order whatever their age; a victim used within evict_grace_s
loses its index rows at once but keeps its file until its grace is over (a
reader that located it still reads the right bytes), within a bound, and a
process killed with deferred unlinks leaves files the next open removes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
from safetensors.numpy import load_file

from npukv_store import KVStore, StoreConfig
from tests.support.blocks import block_tensors, tiny_spec

SPEC = tiny_spec()
#: every save written (admission, docs/decisions/0069, is not under test)
WRITE_ALL = (
    {"admission": "all"} if "admission" in StoreConfig.__dataclass_fields__ else {}
)
CHUNK = 4096 + 2 * SPEC.block_bytes + 2 * 3 * 8  # header, 2 blocks, checksums


def chain(store: KVStore, sym: int) -> list[bytes]:
    return store.keys_for([sym] * 2 * SPEC.block_size)


def config(root, capacity: int, grace: float = 60.0) -> StoreConfig:
    return StoreConfig(
        cache_dir=str(root), capacity=capacity, evict_grace_s=grace, fsync="never",
        **WRITE_ALL,
    )  # fmt: skip


def chunk_path(store: KVStore, chunk_id: int) -> str:
    return os.path.join(store.dir.root, store.dir.chunk_path(store.namespace, chunk_id))


def test_full_directory_of_young_chunks_takes_the_save(tmp_path):
    with KVStore(config(tmp_path / "c", 16 * CHUNK), SPEC) as store:
        first = chain(store, 1)
        store.put(first, block_tensors(SPEC, first))
        (located, _), _ = store.index.locate(first)  # a reader located it
        for sym in range(2, 17):
            keys = chain(store, sym)
            store.put(keys, block_tensors(SPEC, keys))
        assert store.index.lookup_prefix(first) == 2  # all young, directory full
        keys = chain(store, 40)
        result = store.put(keys, block_tensors(SPEC, keys))
        assert (result.stored, result.rejected) == (2, 0)  # not refused
        assert store.index.lookup_prefix(first) == 0  # the oldest left at once
        path = chunk_path(store, located)
        assert os.path.exists(path)  # its file waits for the grace
        rows = load_file(path)
        for name, want in block_tensors(SPEC, first).items():
            np.testing.assert_array_equal(rows[name], want)
        assert located in store.index.dead_chunks()  # tombstoned until unlinked
        assert store.stats().total_bytes <= store.config.capacity
        store.close()
        assert not os.path.exists(path)  # a clean close leaves none behind


def test_deferred_file_goes_once_its_grace_is_over(tmp_path):
    with KVStore(config(tmp_path / "c", 16 * CHUNK, grace=0.2), SPEC) as store:
        keys = [chain(store, sym) for sym in range(1, 18)]
        for k in keys:
            store.put(k, block_tensors(SPEC, k))
        assert store.publisher.deferred.waiting_bytes == CHUNK
        (victim,) = store.publisher.deferred.waiting_ids()
        path = chunk_path(store, victim)
        assert os.path.exists(path)
        time.sleep(0.25)
        store.flush_touches()  # the flush sweeps what is due
        assert store.publisher.deferred.waiting_bytes == 0
        assert not os.path.exists(path)
        assert store.check() == []


def test_deferred_bytes_are_bounded(tmp_path):
    """At most capacity / 16 waits: beyond it a victim's file goes at once."""
    with KVStore(config(tmp_path / "c", 16 * CHUNK), SPEC) as store:
        for sym in range(1, 16 + 6):
            keys = chain(store, sym)
            result = store.put(keys, block_tensors(SPEC, keys))
            assert result.rejected == 0
        deferred = store.publisher.deferred
        assert deferred.waiting_bytes <= deferred.limit_bytes < 2 * CHUNK
        assert store.stats().counters["evicted_chunks"] == 5
        files = len(os.listdir(os.path.dirname(chunk_path(store, 1))))
        assert files == 16 + len(deferred.waiting_ids())


CHILD = """
import sys
from npukv_store import KVStore, StoreConfig
from tests.support.blocks import block_tensors, tiny_spec
spec = tiny_spec()
chunk = 4096 + 2 * spec.block_bytes + 2 * 3 * 8
extra = {"admission": "all"} if "admission" in StoreConfig.__dataclass_fields__ else {}
cfg = StoreConfig(cache_dir=sys.argv[1], capacity=16 * chunk * 4,
                  evict_grace_s=600, fsync="never", **extra)
store = KVStore(cfg, spec)
for sym in range(1, 16 * 4 + 4):
    keys = store.keys_for([sym] * 2 * spec.block_size)
    store.put(keys, block_tensors(spec, keys))
print(",".join(str(i) for i in store.publisher.deferred.waiting_ids()), flush=True)
sys.stdin.read()
"""


def test_kill_with_deferred_unlinks_leaves_files_the_next_open_removes(tmp_path):
    root = str(tmp_path / "c")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), root],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=repo, text=True,
    ) as child:  # fmt: skip
        try:
            assert child.stdout is not None
            line = child.stdout.readline().strip()
        finally:
            os.kill(child.pid, signal.SIGKILL)  # deferred unlinks pending
            child.wait()
    waiting = [int(x) for x in line.split(",") if x]
    assert waiting, "the child deferred no unlink"
    names = {f"{chunk_id:016x}.safetensors" for chunk_id in waiting}
    left = {n for _, _, files in os.walk(root) for n in files if n in names}
    assert left == names  # the kill left the deferred files behind
    with KVStore(config(root, 16 * CHUNK * 4), SPEC) as store:
        for chunk_id in waiting:  # the open found a dead session: recovery ran
            assert not os.path.exists(chunk_path(store, chunk_id))
        assert not set(waiting) & set(store.index.dead_chunks())
        assert store.check() == []
