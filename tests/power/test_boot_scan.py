"""The first open of a boot sweeps what a power cut left (docs/decisions/0072),
shown by the power-loss harness: with the boot record removed, crash states of
a first open keep garbage that check() reports; with it, none (the power-loss
kinds of tests/faults assert that part over every workload)."""

from __future__ import annotations

import pytest

from npukv_store.store import sessions
from tests.power import crashstates, harness, workload


@pytest.mark.timeout(600)
def test_without_the_boot_record_a_power_cut_leaves_garbage(tmp_path, monkeypatch):
    missing = harness.fuse_missing(str(tmp_path))
    if missing:
        pytest.skip(f"power-loss harness: {missing}")
    (tmp_path / "w").mkdir()
    log = harness.record(workload.WORKLOADS["one-process"], str(tmp_path / "w"))
    states = list(crashstates.crash_states(log, "posix", per_point=2, sampled_points=0))
    # the mutation: no open records a new boot, so none scans for garbage
    # (the checks run in forked children, which inherit the patch)
    monkeypatch.setattr(sessions, "_record_boot", lambda cdir, lock_fd: False)
    report = harness.check_states(log, states)
    print(report.summary())
    assert not report.lost, report.summary()
    assert not report.wrong, report.summary()
    assert not report.refused, report.summary()
    garbage = [p for p in report.problems if "tmp garbage" in p or "orphan chunk" in p]
    assert garbage, report.summary()
