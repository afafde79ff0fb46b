"""Power loss (issue 40), one fault kind per workload of tests/power/workload.py
WORKLOADS: ``power-loss-<workload>``.

A trial records the workload once on a cache directory mounted through
RecordFS (FUSE: every write, sync, rename, link and unlink recorded, LMDB's
included), then checks a sample of the crash states that a lost page cache
allows under one persistence model (tests/power/crashstates.py), each opened
by a fresh process (tests/power/harness.py, checks.py). In every state: each
block whose put() returned (fsync=chunk), and no eviction of which had begun,
reads back byte-exact (else ``durable_blocks_lost``), no block reads back
wrong (``wrong_kv_served``), the open never refuses (a refusal to start counts
as a ``process_crashes``), and the rest of the check (check() clean after an
open as a new boot, pins, the removal log) finds no problem (any fails the
test).
Lost and wrong count one per chunk (a put of BLOCKS blocks) and crash state.

The quick form (default run) is one trial per workload, model ``posix`` (a
name is durable only once its directory is synced: the harsher one); the full
form (``-m faults``) two, ``posix`` and ``journal`` (ext4, xfs: any sync
commits every earlier name-space change). The states are a per-form budget
shared by the trials of every workload, so that adding workloads keeps the
run's length: about QUICK_STATES in the quick form (at least QUICK_MIN) and
FULL_STATES in the full one (at least FULL_MIN), never under FLOOR a trial.
"""

from __future__ import annotations

import math
import random

import pytest

from tests.faults.kinds import kind
from tests.power import crashstates, harness, workload

WORKLOADS = workload.WORKLOADS
MODELS = ("posix", "journal")  # trial n of a form checks MODELS[n]
#: crash states per form over all its trials (budget; minimum that must be
#: reached): the quick form about 1.5 min on 2 cores, the full one about 15
QUICK_STATES, QUICK_MIN = 2_000, 1_000
FULL_STATES, FULL_MIN = 25_000, 20_000
FLOOR = 150  # states a trial checks at least, however many workloads there are

#: what each workload of WORKLOADS does, for its kind's row in docs/faults.md
DESCRIBED = {
    "one-process": "the first open of a new directory (marker, secret, index, "
    "sessions, boot, namespace.json) and 3 chunks put by one process",
    "two-processes": "a first process puts 1 chunk, then two processes put 2 "
    "chunks each at once on the same directory",
    "eviction": "7 chunks put into a 4-chunk capacity: LRU eviction, deferred "
    "unlinks, the removal log",
    "pin-unpin": "a chunk pinned, puts past capacity (it stays), an unpin, more "
    "puts (it may go)",
    "tenants": "two tenants, one with half the capacity, putting past it: the "
    "tenant ledger",
    "compaction": "4 small chunks, then the maintenance job: calibration, "
    "compaction's merge and rewrite, gc",
    "rebuild": "2 chunks, an index rebuild (npukv rebuild-index), then 2 more "
    "chunks put",
}
UNDESCRIBED = "(not described: add it to DESCRIBED in tests/faults/test_power_loss.py)"


def kind_name(name: str) -> str:
    return f"power-loss-{name}"


# every workload is a kind, even one not yet described, so that collection
# works and test_every_workload_is_described names what is missing
for _name in WORKLOADS:
    kind(
        kind_name(_name),
        "P3",
        f"power lost at any instant of the {_name} workload, "
        f"{DESCRIBED.get(_name, UNDESCRIBED)}: crash states of a lost page "
        "cache recorded through FUSE (tests/power)",
        "a fresh process opens every crash state as a new boot; every block "
        "whose put() returned (fsync=chunk), and no eviction of which had "
        "begun, reads back byte-exact, none wrong; pins and the removal log "
        "hold; check() finds nothing (the open swept a crash's leftovers)",
    )


def budget(full: bool, workloads: int) -> tuple[int, int]:
    """(states to check, states it must reach) for one trial of one workload:
    the form's budget and minimum shared by every trial of every workload."""
    trials = workloads * (len(MODELS) if full else 1)
    total, least = (FULL_STATES, FULL_MIN) if full else (QUICK_STATES, QUICK_MIN)
    return max(FLOOR, math.ceil(total / trials)), max(FLOOR, math.ceil(least / trials))


def pick_states(
    log: list[tuple], model: str, target: int, seed: int
) -> list[crashstates.CrashState]:
    """``target`` crash states of ``log`` (fewer only if it has fewer): those
    right after each sync and mark with nothing or everything unsynced kept
    (where a lost sync shows first), then a random sample of the rest, drawn
    from ever more states per crash point until there are enough."""
    rng = random.Random(seed)
    base = list(crashstates.crash_states(log, model, per_point=1, sampled_points=0))
    if len(base) >= target:
        return rng.sample(base, target)
    per_point = 4
    while True:  # every operation a candidate crash point
        pool = list(
            crashstates.crash_states(
                log, model, per_point=per_point, sampled_points=len(log), seed=seed
            )
        )
        if len(pool) >= 2 * target or per_point >= 512:
            break
        per_point *= 2
    seen = {state.kept for state in base}
    rest = [state for state in pool if state.kept not in seen]
    return base + rng.sample(rest, min(len(rest), target - len(base)))


@pytest.fixture(scope="module")
def fuse(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip, saying why, where RecordFS cannot mount."""
    missing = harness.fuse_missing(str(tmp_path_factory.mktemp("probe")))
    if missing:
        pytest.skip(f"power-loss harness: {missing}")


def test_every_workload_is_described() -> None:
    """A workload added to tests/power/workload.py gets its kind by itself,
    but its row in docs/faults.md needs a description."""
    # (a description of a workload that is gone is harmless: no kind reads it)
    missing = sorted(set(WORKLOADS) - set(DESCRIBED))
    assert not missing, (
        f"tests/power/workload.py WORKLOADS has {missing} (fault kinds "
        f"{[kind_name(m) for m in missing]}) without a description: add one "
        "per workload to DESCRIBED in tests/faults/test_power_loss.py, then "
        "regenerate docs/faults.md's table with python -m tests.faults.kinds"
    )


def test_budgets_add_up() -> None:
    """However many workloads, the forms reach their minimums in total."""
    for workloads in (1, 2, 3, 7, 12, 40):
        quick, quick_least = budget(False, workloads)
        full, full_least = budget(True, workloads)
        assert quick_least * workloads >= QUICK_MIN
        assert full_least * workloads * len(MODELS) >= FULL_MIN
        # and stay near their budgets (ceil: one state a workload more)
        assert quick * workloads <= max(QUICK_STATES + workloads, FLOOR * workloads)
        assert full * workloads * len(MODELS) <= max(
            FULL_STATES + 2 * workloads, FLOOR * 2 * workloads
        )


@pytest.mark.timeout(3600)  # the full form: about 25,000 states in all
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.fault(kind_name(n))) for n in WORKLOADS],
)
def test_power_loss(fault, fuse: None, tmp_path, name: str) -> None:
    target, least = budget(fault.full, len(WORKLOADS))
    seed = random.randrange(2**32)
    for trial in fault.trials(1, len(MODELS)):
        model = MODELS[trial]
        workdir = tmp_path / f"trial{trial}"
        workdir.mkdir()
        log = harness.record(WORKLOADS[name], str(workdir))
        states = pick_states(log, model, target, seed + trial)
        report = harness.check_states(log, states)
        where = f"{name} {model} seed {seed + trial} ({harness.describe(log)})"
        print(where, report.summary())
        fault.checked_states(report.states)
        fault.wrong(len(report.wrong), f"{where}: {report.wrong[:3]}")
        fault.lost(len(report.lost), f"{where}: {report.lost[:3]}")
        if report.refused:
            fault.crashed(
                f"{where} refused to open: {report.refused[:2]}", len(report.refused)
            )
        assert not report.problems, report.summary()
        assert report.states >= least, (
            f"{where}: {report.states} crash states, the form needs {least} a "
            f"trial ({report.summary()})"
        )
