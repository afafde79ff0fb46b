"""Concurrent processes on one cache directory: reads are right or miss, never wrong.

Four ``spawn``ed workers put, look up and read prompts that share prefixes (so
they race on the same keys) in a cache that holds about eight chunks (so puts
evict and are rejected all the time). The scenario (``multiprocess.run_multiprocess``)
proves, for a 5 s run:

* every read() hit holds exactly the bytes derived from its key; half the workers
  read with ``verify="never"``, so a wrong row is compared, not masked as a miss;
* ``stats().total_bytes``, sampled by every worker after every operation and by
  the parent every few ms, never exceeds capacity plus one chunk;
* no worker raises, no checksum or header error is ever counted, and eviction
  really happened (a run that has not by its end goes on, forcing it; a run
  that still has not is run again with another seed, never passed);
* afterwards the reopened directory passes ``check(verify_data=True)``, every
  indexed key reads back, and tmp/ is empty.

The stress form (``tests/stress/test_stress.py``) runs the same scenario longer.
"""

from __future__ import annotations

import random

import pytest

from tests.support.scenarios import multiprocess

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_workers_race_on_shared_prefixes_under_eviction(tmp_path, mode):
    def attempt(number: int) -> dict:
        return multiprocess.run_multiprocess(
            str(tmp_path / f"cache{number}"),
            workers=4,
            seconds=5.0,
            capacity_chunks=8,
            grace_s=0.05,  # at 0.2 s nearly every put is rejected: little eviction
            fsync="never",
            seed=random.randrange(2**32),  # every failure message names it
            mode=mode,
        )

    summary = multiprocess.until_exercised(attempt)
    totals = summary["totals"]
    # run_multiprocess asserts correctness, and that the run had real
    # contention (it goes on, forcing them, until these happened):
    assert totals["counter.evicted_chunks"] > 0, summary
    assert totals["put_rejected"] + totals["put_skipped"] > 0, summary
    assert summary["max_total_parent"] <= summary["capacity"] + summary["chunk_max"]


@pytest.mark.timeout(120)
def test_a_worker_exception_fails_the_scenario_with_its_traceback(tmp_path):
    """The harness itself: a worker that raises must not pass silently."""
    with pytest.raises(AssertionError) as failure:
        multiprocess.run_multiprocess(
            str(tmp_path / "cache"),
            workers=2,
            seconds=3.0,
            capacity_chunks=8,
            grace_s=0.05,
            fault_after_s=0.2,
        )
    message = str(failure.value)
    assert "worker 0 raised" in message
    assert "Traceback" in message
    assert "injected worker fault" in message


OPENER = """
import os, sys, time
from npukv_store import KVStore, StoreConfig
from tests.support.blocks import block_tensors, tiny_spec
root, go, number, stay = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
while not os.path.exists(go):
    time.sleep(0.005)
store = KVStore(StoreConfig(cache_dir=root, fsync="never"), tiny_spec())
keys = store.keys_for(range(number * 100, number * 100 + 32))
store.put(keys, block_tensors(store.spec, keys))
if stay == "close":
    store.close()
print("done", flush=True)
if stay == "hold":
    time.sleep(600)
"""


@pytest.mark.timeout(240)
def test_seventeen_processes_open_at_once_and_the_dead_are_counted(tmp_path):
    """17 processes open one directory at once (as a TP 16 engine and its
    scheduler do) and each puts a chunk; 6 are SIGKILLed with the store open,
    the rest close. The next open finds exactly the 6 sessions dead (two
    sessions sharing a slot would lose one), scans once, and every key of
    every process reads back; the open after it finds none."""
    import os
    import signal
    import subprocess
    import sys

    from npukv_store import KVStore, StoreConfig
    from tests.support.blocks import empty_blocks, tiny_spec, verify_read

    root, go = str(tmp_path / "c"), str(tmp_path / "go")
    config = StoreConfig(cache_dir=root, fsync="never")
    KVStore(config, tiny_spec()).close()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    killed = set(range(0, 17, 3))  # 6 of 17
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                OPENER,
                root,
                go,
                str(n),
                "hold" if n in killed else "close",
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=repo,
        )  # fmt: skip
        for n in range(17)
    ]
    open(go, "w").close()
    try:
        for child in children:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "done"
    finally:
        for n, child in enumerate(children):
            if n in killed:
                child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
            assert child.stdout is not None
            child.stdout.close()
    assert [c.returncode for n, c in enumerate(children) if n not in killed] == [0] * 11
    with KVStore(config, tiny_spec()) as store:
        dead = {int(v.split(b"@")[0]) for v in store._session.dead.values()}
        assert dead == {children[n].pid for n in killed}
        for n in range(17):
            keys = store.keys_for(range(n * 100, n * 100 + 32))
            out = empty_blocks(store.spec, len(keys))
            assert verify_read(store.spec, keys, out, store.read(keys, out)) == []
        assert store.check(verify_data=True) == []
    with KVStore(config, tiny_spec()) as store:
        assert store._session.dead == {}
