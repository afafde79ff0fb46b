"""Power loss (issue 40): the harness has teeth. The crash states themselves
are checked in the fault suite, one kind per workload
(tests/faults/test_power_loss.py); here each sync the store relies on is
removed in turn and the harness must see a crash state go wrong
(tests/power/harness.py, docs/decisions/0071).
"""

from __future__ import annotations

import pytest

from tests.power import crashstates, harness, workload

WORKLOADS = workload.WORKLOADS


@pytest.fixture(scope="module")
def fuse(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip, saying why, where RecordFS cannot mount."""
    missing = harness.fuse_missing(str(tmp_path_factory.mktemp("probe")))
    if missing:
        pytest.skip(f"power-loss harness: {missing}")


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
