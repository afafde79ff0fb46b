"""The maintenance job runs while servers read and write: every read is right or
a miss, never wrong bytes.

Three spawned workers put, look up and read prompts with shared prefixes
(``multiprocess.run_multiprocess``: half of them read with ``verify="never"``, so a
wrong row is compared byte for byte instead of being masked as a checksum miss),
under a capacity that makes their commits evict. Meanwhile the parent runs the
whole maintenance job (garbage, verify, eviction to a target, compaction) in a
loop for the whole run, at least 10 s. Afterwards: the workers saw no wrong
byte, the job really rewrote chunks many times, and the directory passes
``check(verify_data=True)`` with every indexed key readable.

The run is randomized: where it has not yet exercised what it checks (commits
that evict, stores, skips, read hits, the job's merges) by its 10 s, the
workers go on, forcing what is missing, for up to 30 s more; a run that even
then has not is run again with another seed (``multiprocess.until_exercised``),
never passed and never failed for it.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from npukv_store.maintenance import Options, run
from tests.support.scenarios import multiprocess

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_compaction_in_a_loop_while_three_processes_read_and_write(tmp_path, mode):
    def attempt(number: int) -> dict:
        return _live_compaction(tmp_path / f"run{number}", mode)

    summary = multiprocess.until_exercised(attempt)
    done = summary["maintenance"]
    # run_multiprocess asserted: no wrong byte, no worker error, capacity kept,
    # and afterwards check(verify_data=True) is clean; that the run exercised
    # eviction, stores, skips and read hits, and _merged(done) (the workers go
    # on, forcing them, until both hold).
    assert _merged(done), done
    assert done["quarantined"] == 0, (done, summary["seed"])  # never corrupt
    assert summary["totals"]["read_hits"] > 0, summary


def _merged(done: Counter[str]) -> bool:
    """The job ran 10 times or more and really merged chunks."""
    return done["runs"] >= 10 and done["rewritten"] > done["written"] > 0


def _live_compaction(root: Path, mode: str) -> dict:
    seed = random.randrange(2**32)
    cache = str(root / "cache")
    done: Counter[str] = Counter()
    rng = random.Random(seed)

    def maintain():
        if not (Path(cache) / "NPUKV_STORE").exists():
            return
        # eviction to a target needs the capacity a worker's commit records
        with_target = done["saw_chunks"] > 0 and rng.random() < 0.3
        summary = run(
            Options(
                cache_dir=cache,
                verify=rng.random() < 0.3,
                target=0.5 if with_target else None,
                min_live=1.0,  # rewrite every chunk with a dead row
                grace_s=0.05,
                ring_dir=str(root),
            )
        )
        done["runs"] += 1
        done["saw_chunks"] += summary.chunks_before > 0
        done["rewritten"] += summary.rewritten
        done["written"] += summary.written
        done["evicted"] += summary.evicted
        done["quarantined"] += summary.quarantined

    summary = multiprocess.run_multiprocess(
        cache,
        workers=3,
        seconds=10.0,
        capacity_chunks=16,
        grace_s=0.05,
        fsync="never",
        seed=seed,
        mode=mode,
        during=maintain,
        until=lambda: _merged(done),
    )
    print(f"live compaction ({mode}, seed {seed}): {dict(done)}")
    summary["maintenance"] = done
    return summary
