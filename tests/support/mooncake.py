"""Mooncake for the tests: require_mooncake() skips a test where the tier
cannot run (fails it under CI); the master and pool themselves are
bench/harness/mooncake.py's, shared with the remote tier's benchmark."""

from __future__ import annotations

import os

import pytest

from bench.harness.mooncake import (
    HOST,
    WHEEL,
    MooncakeMaster,
    MooncakePool,
    free_ports,
    import_failure_reason,
    mooncake_unavailable,
)

__all__ = [
    "HOST", "WHEEL", "MooncakeMaster", "MooncakePool", "free_ports",
    "import_failure_reason", "mooncake_unavailable", "require_mooncake", "under_ci",
]  # fmt: skip


def under_ci() -> bool:
    """Whether the CI variable is set (CI=true, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_mooncake() -> None:
    """Skip the calling test when Mooncake cannot run here; under CI fail it
    instead, so that a broken setup cannot pass as a green run of skips."""
    reason = mooncake_unavailable()
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"Mooncake is unavailable under CI: {reason}", pytrace=False)
    pytest.skip(reason)
