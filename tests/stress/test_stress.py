"""Stress forms of the multi-process and SIGKILL scenarios (``pytest -m stress``).

Same scenarios and oracles as ``tests/store/test_multiprocess.py`` and
``test_crash.py`` (see ``tests/support/scenarios/``), run longer and with more kills:

* multi-process: 6 spawned workers for ``--seconds`` (default 20) on a cache of
  eight chunks; every read is right or a miss, the ledger stays within capacity
  plus one chunk, and the directory checks clean with data afterwards;
* crash: ``--trials`` (default 50) SIGKILLs of a writer, a third of them placed
  in each publish window in turn, the rest at random 0-150 ms delays with plain
  and window-widening children alternating;
* crash during eviction: ``--trials // 2`` kills of an always-evicting writer,
  a third placed in the eviction windows.

Also a script, for longer or reproducible runs::

    python -m tests.stress.test_stress --seconds 20 --trials 50 [--seed N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.support.scenarios import crash, crash_plan, multiprocess

DEFAULT_SECONDS = 20.0
DEFAULT_TRIALS = 50
DEFAULT_WORKERS = 6

pytestmark = pytest.mark.stress


def multiprocess_stress(
    root: Path,
    *,
    seconds: float,
    workers: int,
    seed: int,
    grace_s: float = 0.05,
    mode: str = "sync",
) -> dict[str, Any]:
    def attempt(number: int) -> dict[str, Any]:
        # a run that found no fault but did not exercise eviction (even with
        # its overtime) is run again, on the next seed
        return multiprocess.run_multiprocess(
            str(root / f"mp-cache-{mode}-{number}"),
            workers=workers,
            seconds=seconds,
            capacity_chunks=8,
            grace_s=grace_s,
            fsync="never",
            seed=seed + number,
            mode=mode,
        )

    return multiprocess.until_exercised(attempt)


def crash_stress(
    root: Path, *, trials: int, seed: int, mode: str = "sync"
) -> dict[str, Any]:
    plan = crash_plan.mixed_plan(trials, random.Random(seed), crash_plan.PUBLISH_PHASES)
    return crash.run_crash_trials(
        str(root / f"crash-cache-{mode}"),
        str(root / f"crash-logs-{mode}"),
        plan,
        seed=seed,
        mode=mode,
    )


def evict_crash_stress(root: Path, *, trials: int, seed: int) -> dict[str, Any]:
    plan = crash_plan.mixed_plan(trials, random.Random(seed), crash_plan.EVICT_PHASES)
    return crash.run_crash_trials(
        str(root / "evict-cache"),
        str(root / "evict-logs"),
        plan,
        evict=True,
        seed=seed,
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_multiprocess_stress(tmp_path, mode):
    seed = random.randrange(2**32)  # every failure message names it
    summary = multiprocess_stress(
        tmp_path,
        seconds=DEFAULT_SECONDS,
        workers=DEFAULT_WORKERS,
        seed=seed,
        mode=mode,
    )
    assert summary["totals"]["counter.evicted_chunks"] > 0, summary


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_crash_stress(tmp_path, mode):
    seed = random.randrange(2**32)
    summary = crash_stress(tmp_path, trials=DEFAULT_TRIALS, seed=seed, mode=mode)
    assert summary["trials"] == DEFAULT_TRIALS
    assert summary["returned_keys_verified"] > 0, summary


@pytest.mark.timeout(600)
def test_evict_crash_stress(tmp_path):
    seed = random.randrange(2**32)
    summary = evict_crash_stress(tmp_path, trials=DEFAULT_TRIALS // 2, seed=seed)
    assert summary["killed_in.evicted"] > 0, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS)
    parser.add_argument(
        "--evict-trials", type=int, default=None, help="default: --trials // 2"
    )
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    parser.add_argument("--grace", type=float, default=0.05, help="evict_grace_s")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument(
        "--dir", type=Path, default=None, help="work directory (default: a temp dir)"
    )
    parser.add_argument(
        "--only",
        choices=("multiprocess", "crash", "evict"),
        action="append",
        help="run only these scenarios (repeatable)",
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("error")  # as under pytest: a warning is a failure
    seed = random.randrange(2**32) if args.seed is None else args.seed
    only = set(args.only or ("multiprocess", "crash", "evict"))
    evict_trials = args.trials // 2 if args.evict_trials is None else args.evict_trials
    with tempfile.TemporaryDirectory(prefix="npukv-stress-") as scratch:
        root = args.dir or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        runs = {
            "multiprocess": lambda: multiprocess_stress(
                root,
                seconds=args.seconds,
                workers=args.workers,
                seed=seed,
                grace_s=args.grace,
                mode=args.mode,
            ),
            "crash": lambda: crash_stress(
                root, trials=args.trials, seed=seed, mode=args.mode
            ),
            "evict": lambda: evict_crash_stress(root, trials=evict_trials, seed=seed),
        }
        for name, run in runs.items():
            if name not in only:
                continue
            start = time.monotonic()
            summary = run()  # raises AssertionError naming the seed on failure
            wall = time.monotonic() - start
            print(f"{name}: ok in {wall:.1f} s (seed {seed})")
            print(json.dumps(summary, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
