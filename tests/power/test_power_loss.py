"""Power loss (issue 40): crash states that a lost page cache allows, each
opened by a fresh process (tests/power/harness.py, docs/decisions/0071).

A workload runs on a cache directory mounted through RecordFS (FUSE, every
write, sync, rename, link and unlink recorded, LMDB's included); crash states
keep everything synced and some of the rest (crashstates.py: a prefix in
order, a cut per file, or each operation by a coin flip). In each state:
every block whose put() returned (fsync=chunk) reads back byte-exact, no block
reads back wrong, the open never refuses, and check() finds nothing but crash
leftovers.

The quick form (default run) checks over 1,000 states of the ``posix`` model
(a name is durable only once its directory is synced: the harsher one); the
full form (``-m faults``) many more, of ``posix`` and of ``journal`` (ext4,
xfs: any sync commits every earlier name-space change).
"""

from __future__ import annotations

import pytest

from tests.power import crashstates, harness, workload

WORKLOADS = workload.WORKLOADS
#: (per_point, sampled_points) per form: the quick form's states total > 1,000
FORMS = {"quick": (6, 60), "full": (25, 600)}


@pytest.fixture(scope="module")
def fuse(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip, saying why, where RecordFS cannot mount."""
    missing = harness.fuse_missing(str(tmp_path_factory.mktemp("probe")))
    if missing:
        pytest.skip(f"power-loss harness: {missing}")


@pytest.fixture(scope="module")
def logs(fuse: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    return {
        name: harness.record(steps, str(tmp_path_factory.mktemp(name)))
        for name, steps in WORKLOADS.items()
    }


def _states(log: list[tuple], model: str, form: str) -> list[crashstates.CrashState]:
    per_point, sampled = FORMS[form]
    states = crashstates.crash_states(
        log, model, per_point=per_point, sampled_points=sampled
    )
    return list(states)


def _assert_holds(report: harness.Report) -> None:
    print(report.summary())
    assert not report.refused, report.summary()
    assert not report.lost, report.summary()
    assert not report.wrong, report.summary()
    assert not report.problems, report.summary()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_power_loss_quick(logs: dict[str, list[tuple]], workload: str) -> None:
    log = logs[workload]
    report = harness.check_states(log, _states(log, "posix", "quick"))
    print(workload, harness.describe(log))
    _assert_holds(report)
    assert report.states >= 500, report.summary()  # 2 workloads: over 1,000 together


@pytest.mark.faults
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("model", ["posix", "journal"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_power_loss_full(logs: dict[str, list], workload: str, model: str) -> None:
    log = logs[workload]
    report = harness.check_states(log, _states(log, model, "full"))
    print(workload, model, harness.describe(log))
    _assert_holds(report)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mutation", sorted(harness.workload.MUTABLE))
def test_a_removed_sync_is_caught(fuse: None, tmp_path, mutation: str) -> None:
    """The harness has teeth. With the chunk file's fsync and its
    directory's removed, or those of dirfd.py (a new directory's parent, the
    root after the marker, the secret and a fresh index; decision 0071), a
    crash state loses a published block; with those of directory.py
    (namespace.json's, 0071, the marker's and the secret's), a state refuses
    to open for an empty namespace.json. Never a wrong block."""
    log = harness.record(WORKLOADS["one-process"], str(tmp_path), mutation=mutation)
    states = crashstates.crash_states(log, "posix", per_point=1, sampled_points=0)
    report = harness.check_states(log, list(states))
    print(mutation, report.summary())
    assert not report.wrong, report.summary()
    if mutation == "namespace-fsync":
        assert any("NamespaceMismatch" in line for line in report.refused), (
            report.summary()
        )
    else:
        assert report.lost, report.summary()
