"""The security suite's accounting: attack kinds, trials, escapes and
crashes, and docs/security.json.

Every test here takes the ``attack`` fixture and names each attack it tries::

    def test_tmp_symlink_is_not_followed(attack, tmp_path):
        with attack("symlink: tmp/ -> outside"):
            ...  # mount the attack, then assert it failed

An attack *escapes* when its block raises AssertionError (what it aimed at
was reached); it *crashes* when a process died by a signal or the block
raised anything else (a fault that should have been a miss or one clear
error). A test fails on either, so a green run has 0 of both.

docs/security.json is rewritten when the run held every test of this folder
(``pytest tests/security``, as scripts/test.sh runs it), and written to
``NPUKV_SECURITY_JSON`` whenever that is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench import host

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCS_JSON = ROOT / "docs" / "security.json"


@dataclass
class Kind:
    trials: int = 0
    escapes: int = 0
    crashes: int = 0
    tests: set[str] = field(default_factory=set)


KINDS: dict[str, Kind] = {}
_RAN: set[str] = set()  # tests of this folder that ran or were skipped
_COLLECTED: set[str] = set()


class Attack:
    """The ``attack`` fixture: ``with attack(kind): ...`` runs one trial."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.failures: list[str] = []

    @contextlib.contextmanager
    def __call__(self, kind: str) -> Iterator[None]:
        entry = KINDS.setdefault(kind, Kind())
        entry.trials += 1
        entry.tests.add(self.nodeid)
        try:
            yield
        except AssertionError as exc:
            entry.escapes += 1
            self.failures.append(f"{kind}: escaped: {exc}")
            raise
        except Exception as exc:
            entry.crashes += 1
            self.failures.append(f"{kind}: crashed: {type(exc).__name__}: {exc}")
            raise

    def crashed(self, kind: str, why: str) -> None:
        """Count a crash seen outside a ``with`` block (a child killed by a
        signal) and fail the test."""
        entry = KINDS.setdefault(kind, Kind())
        entry.crashes += 1
        self.failures.append(f"{kind}: crashed: {why}")
        pytest.fail(f"{kind}: crashed: {why}")


@pytest.fixture
def attack(request: pytest.FixtureRequest) -> Attack:
    return Attack(request.node.nodeid)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            _COLLECTED.add(item.nodeid)


def _all_collected(session: pytest.Session) -> bool:
    """Whether this run selected every test of tests/security (no -k, no
    single file)."""
    args = [Path(a.split("::")[0]).resolve() for a in session.config.args]
    args = args or [Path(str(session.config.rootpath))]
    whole = any(HERE.is_relative_to(a) for a in args if a.exists())
    return whole and not session.config.option.keyword and bool(_COLLECTED)


def summary() -> dict[str, Any]:
    kinds = [
        {"kind": name, "trials": k.trials, "escapes": k.escapes, "crashes": k.crashes}
        for name, k in sorted(KINDS.items())
    ]
    return {
        "attacks": len(kinds),
        "trials": sum(k["trials"] for k in kinds),
        "escapes": sum(k["escapes"] for k in kinds),
        "crashes": sum(k["crashes"] for k in kinds),
        "kinds": kinds,
        "commit": host.commit(),
        "host": platform.node(),
        "uid": os.geteuid(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not KINDS:
        return
    body = json.dumps(summary(), indent=1) + "\n"
    if os.environ.get("NPUKV_SECURITY_JSON"):
        Path(os.environ["NPUKV_SECURITY_JSON"]).write_text(body)
    if _all_collected(session) and _COLLECTED <= _RAN:
        DOCS_JSON.write_text(body)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid in _COLLECTED and (report.when == "call" or report.skipped):
        _RAN.add(report.nodeid)  # (skips say why: no root, no Mooncake)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not KINDS:
        return
    body = summary()
    terminalreporter.write_sep("=", "security attacks")
    for kind in body["kinds"]:
        terminalreporter.write_line(
            f"{kind['kind']:<58} trials {kind['trials']:>6}  escapes "
            f"{kind['escapes']}  crashes {kind['crashes']}"
        )
    terminalreporter.write_line(
        f"{body['attacks']} attack kinds, {body['trials']} trials, "
        f"{body['escapes']} escapes, {body['crashes']} crashes"
    )
