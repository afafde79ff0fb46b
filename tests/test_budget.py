"""The machine-bound tests' timeouts stretch with the machine as each test
starts (tests/conftest.py, tests/support/budget.py): a busy host slows them,
it does not hang them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import conftest
from tests.support import budget


class _Item:
    """What the hook reads of a pytest item."""

    def __init__(self, path: str, marks: list[pytest.MarkDecorator]) -> None:
        self.fspath = path
        self.marks = [m.mark for m in marks]
        self.config = type("C", (), {"getini": staticmethod(lambda name: "300")})()

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, marker: pytest.MarkDecorator, append: bool = True) -> None:
        self.marks.insert(len(self.marks) if append else 0, marker.mark)


def _run_hook(item: _Item) -> None:
    hook = conftest.pytest_runtest_protocol(item)  # a hookwrapper: run to yield
    next(hook)


@pytest.mark.parametrize(
    ("path", "marks", "expected"),
    [
        # the e2e directory, pyproject's 300 s: 3 x 300
        ("tests/e2e/test_vllm.py", [], 900),
        # an e2e mark elsewhere, its own 600 s: 3 x 600
        (
            "tests/faults/test_vllm.py",
            [pytest.mark.e2e, pytest.mark.timeout(600)],
            1800,
        ),
        # the power-loss harness
        ("tests/faults/test_power_loss.py", [pytest.mark.timeout(600)], 1800),
        # anything else keeps its own
        ("tests/store/test_store.py", [pytest.mark.timeout(60)], 60),
    ],
)
def test_machine_bound_timeouts_scale_as_the_test_starts(
    monkeypatch: pytest.MonkeyPatch, path: str, marks: list, expected: int
) -> None:
    monkeypatch.setattr(budget, "machine_scale", lambda: 3.0)
    item = _Item(str(Path("/repo") / path), marks)
    _run_hook(item)
    assert item.get_closest_marker("timeout").args[0] == expected


def test_the_scale_is_bounded_so_a_hung_test_still_fails(monkeypatch):
    monkeypatch.setattr(budget.os, "getloadavg", lambda: (1000.0, 0.0, 0.0))
    assert budget.machine_scale() == budget.MAX_SCALE
    monkeypatch.setattr(budget.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(budget.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert budget.machine_scale() == 1.0  # an idle large machine: the base
