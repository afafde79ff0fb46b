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
