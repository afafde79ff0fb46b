"""Fixtures for the Mooncake Store tier tests: a real mooncake_master per test,
and the tiers and stores a test makes on it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.mooncake import MooncakeMaster, require_mooncake
from tests.support.remote import Nodes


def pytest_configure(config: pytest.Config) -> None:
    # Without a master, a client's setup() retries for about 90 s by default;
    # one try (about 4 s) lets a test fail fast. Set before any test module is
    # imported; a value the caller set already is kept.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")


@pytest.fixture
def mooncake_master(tmp_path):
    """A started MooncakeMaster on fresh loopback ports, killed at teardown.
    Skips when Mooncake cannot run here, but fails under CI (CI=true)."""
    require_mooncake()
    master = MooncakeMaster(tmp_path)
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def nodes(mooncake_master, tmp_path) -> Iterator[Nodes]:
    """The test's tiers and stores on ``mooncake_master``, closed at its end
    (before the master stops)."""
    made = Nodes(mooncake_master, tmp_path)
    try:
        yield made
    finally:
        made.close()
