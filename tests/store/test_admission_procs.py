"""Admission across processes (issue 39): four processes on one directory
share one capacity, one write budget and one ghost; a process killed -9
while admitting leaves the admission tables consistent and the directory
prefix-closed and readable."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

from npukv_store import KVStore
from npukv_store.config import StoreConfig
from npukv_store.store import index_admission as table
from npukv_store.store.admission import AdmissionTuning
from tests.support.block_tree import BlockTree, key

ROW = 512
TUNING = AdmissionTuning(shadow_blocks=16, ghost_per_block=1.0, ghost_max=48)
NODES = 400
#: a bushy tree: many chains share short prefixes
TREE = BlockTree(NODES, seed=11, row=ROW, bushy=8)
SPEC = TREE.spec
CAPACITY = 64 << 10  # 64 blocks of 1 KiB, and the chunks' headers
BUDGET = 48 * 24 * 1024  # bytes a day: a bucket of 48 KiB (an hour's worth)


def config(root: str, policy: str, budget: int) -> StoreConfig:
    return StoreConfig(
        cache_dir=root, capacity=CAPACITY, fsync="never", evict_grace_s=0,
        admission=policy, write_budget=budget,
    )  # fmt: skip


def serve(store: KVStore, node: int) -> int:
    """One request as the connector serves it; the wrong rows read back."""
    blocks = TREE.chain(node)
    keys = [key(b) for b in blocks]
    hit = store.lookup(keys)
    wrong = 0
    if hit:
        out = {n: np.zeros((hit, ROW), np.uint8) for n in ("l.k", "l.v")}
        ok = store.read(keys[:hit], out)
        want = TREE.rows(blocks[:hit])
        wrong = sum(
            good and not all(np.array_equal(out[n][i], want[n][i]) for n in out)
            for i, good in enumerate(ok)
        )
        hit = ok.index(False) if False in ok else hit
    if hit < len(keys):
        store.put(
            keys[hit:], TREE.rows(blocks[hit:]), parent=keys[hit - 1] if hit else None
        )
    return wrong


def replay(root: str, policy: str, budget: int, worker: int, out: object) -> None:
    rng = np.random.default_rng(100 + worker)
    with KVStore(config(root, policy, budget), SPEC, admission_tuning=TUNING) as store:
        wrong = sum(serve(store, int(n)) for n in rng.zipf(1.3, 300) % NODES)
        counters = store.counters.snapshot()
    out.put((worker, wrong, counters["put_bytes"]))  # type: ignore[attr-defined]


def stranded(store: KVStore) -> list[int]:
    stored = [b for b in range(NODES) if store.index.locate([key(b)])[0] is not None]
    held = set(stored)
    return [b for b in stored if TREE.parent[b] >= 0 and TREE.parent[b] not in held]


def test_four_processes_share_one_capacity_one_budget_and_one_ghost(tmp_path):
    root = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start = time.monotonic()
    procs = [
        ctx.Process(target=replay, args=(root, "auto", BUDGET, w, queue))
        for w in range(4)
    ]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    elapsed = time.monotonic() - start
    assert sum(wrong for _, wrong, _ in results) == 0
    written = sum(put for _, _, put in results)
    with KVStore(config(root, "auto", BUDGET), SPEC, admission_tuning=TUNING) as store:
        admitter = store.admitter
        report = store.index.admission_report()
        # one budget for all four: what they wrote together stays within one
        # bucket, its refill, and a chunk in flight per process
        largest_chunk = 32 * 2 * ROW + 4096
        limit = admitter.bucket_size + admitter.rate * elapsed + 4 * largest_chunk
        assert written <= limit
        assert written > 0
        # the directory's counters add up every process's writes
        recorded = sum(t.get("written_bytes", 0) for t in report["tenants"].values())
        assert recorded == written
        declined = sum(t.get("declined_blocks", 0) for t in report["tenants"].values())
        assert declined > 0  # the budget (and second sight) declined saves
        assert store.stats().total_bytes <= CAPACITY
        assert report["tables"]["ghost"] <= admitter.ghost_limit
        assert report["tables"]["processes"] <= 5  # one score record each
        assert 0 < report["tables"]["ask_log"] <= table.ASK_LOG_ENTRIES
        assert report["shadow_asks"] > 0  # every process's shadow, summed
        assert store.index.admission_problems() == []
        assert stranded(store) == []


def admit_forever(root: str, ready: str) -> None:
    with KVStore(config(root, "auto", 0), SPEC, admission_tuning=TUNING) as store:
        rng = np.random.default_rng(5)
        for i, node in enumerate(rng.zipf(1.3, 100_000) % NODES):
            serve(store, int(node))
            if i == 20:
                open(ready, "w").close()
            store.flush_touches()  # admission's changes go in every step


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2])
def test_kill_9_while_admitting_leaves_the_tables_consistent(tmp_path, delay_s):
    root = str(tmp_path / "cache")
    ready = str(tmp_path / "ready")
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=admit_forever, args=(root, ready))
    child.start()
    deadline = time.monotonic() + 120  # a hung child fails, it never passes
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(ready), "the admitting process never got going"
    time.sleep(delay_s)
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    with KVStore(config(root, "auto", 0), SPEC, admission_tuning=TUNING) as store:
        assert store.index.admission_problems() == []
        admitter = store.admitter
        tables = store.index.admission_report()["tables"]
        assert tables["ghost"] <= admitter.ghost_limit
        assert tables["processes"] <= 2
        assert stranded(store) == []
        assert store.check() == []
        # and it goes on admitting, reading back what it wrote
        assert sum(serve(store, n) for n in range(0, NODES, 7)) == 0
        assert store.index.admission_problems() == []
