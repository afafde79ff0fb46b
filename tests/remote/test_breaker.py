"""The remote tier's circuit breaker against a model of it: random calls on a
monotonic fake clock (pure, no Mooncake)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from npukv_store.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class BreakerMachine(RuleBasedStateMachine):
    """Tracks the state, wait and retry time the breaker must have, and every
    transition, and checks each answer and log line against them."""

    @initialize(
        first=st.floats(0.01, 5.0),
        factor=st.floats(1.0, 64.0),
    )
    def make(self, first: float, factor: float) -> None:
        self.first, self.max = first, first * factor
        self.breaker = CircuitBreaker(first_wait_s=self.first, max_wait_s=self.max)
        self.now = 1000.0
        self.state = CLOSED
        self.wait = 0.0
        self.retry_at = 0.0
        self.probes_this_opening = 0  # allow() answered True since it opened
        self.openings = 0  # closed -> open
        self.closings = 0  # open/half-open -> closed
        self.lines = 0  # log lines returned

    # -- the clock ------------------------------------------------------------

    @rule(dt=st.floats(0.0, 10.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.state == OPEN)
    @rule(early=st.floats(0.0, 1.0))
    def tick_to_retry(self, early: float) -> None:
        """Land just before or exactly on the retry time (the edges)."""
        target = self.retry_at - (early if early < 0.5 else 0.0)
        self.now = max(self.now, target)

    # -- the calls ------------------------------------------------------------

    @rule()
    def allow(self) -> None:
        got = self.breaker.allow(self.now)
        if self.state == CLOSED:
            assert got is True
        elif self.state == OPEN and self.now >= self.retry_at:
            assert got is True, "the probe after the wait was refused"
            self.state = HALF_OPEN
            self.probes_this_opening += 1
        else:
            assert got is False, (
                f"allowed while {self.state} at {self.now} (retry at {self.retry_at})"
            )
        if self.state != CLOSED:
            assert self.probes_this_opening <= 1

    @rule(many=st.integers(1, 5))
    def allow_many(self, many: int) -> None:
        for _ in range(many):
            self.allow()

    @rule()
    def success(self) -> None:
        line = self.breaker.success(self.now)
        if self.state == CLOSED:
            assert line is None
        else:
            assert line is not None
            assert "back" in line
            self.closings += 1
            self.lines += 1
        self.state, self.wait, self.probes_this_opening = CLOSED, 0.0, 0

    @rule(reason=st.sampled_from(["get_size returned -900", "stalled", "x"]))
    def failure(self, reason: str) -> None:
        line = self.breaker.failure(self.now, reason)
        if self.state == CLOSED:
            self.wait = self.first
            assert line is not None
            assert "down" in line
            assert reason in line
            self.openings += 1
            self.lines += 1
        else:
            self.wait = min(self.max, self.wait * 2)
            assert line is None, f"a second line while {self.state}: {line}"
        self.state, self.retry_at = OPEN, self.now + self.wait
        self.probes_this_opening = 0
        assert self.breaker.reason == reason

    # -- invariants -----------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        breaker = self.breaker
        assert breaker.state == self.state
        assert breaker.up == (self.state == CLOSED)
        if self.state != CLOSED:
            assert breaker.wait_s == pytest.approx(self.wait)
            assert self.first <= breaker.wait_s <= self.max * (1 + 1e-9)
            assert breaker.retry_at == pytest.approx(self.retry_at)
        assert self.lines == self.openings + self.closings
        assert self.closings <= self.openings <= self.closings + 1


BreakerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
test_breaker_against_its_model = BreakerMachine.TestCase


def test_waits_double_up_to_the_cap():
    breaker = CircuitBreaker(first_wait_s=1.0, max_wait_s=30.0)
    now, waits = 0.0, []
    assert breaker.failure(now, "down") is not None
    for _ in range(8):
        waits.append(breaker.wait_s)
        assert not breaker.allow(breaker.retry_at - 1e-6)
        now = breaker.retry_at
        assert breaker.allow(now)  # the one probe
        assert breaker.state == HALF_OPEN
        assert not breaker.allow(now + 100.0)  # no second probe, however late
        assert breaker.failure(now, "still down") is None
    assert waits == [1, 2, 4, 8, 16, 30, 30, 30]
    line = breaker.success(now)
    assert line is not None
    assert "back" in line
    assert breaker.state == CLOSED
    assert breaker.wait_s == 0.0
    # and a fresh outage starts from the first wait again
    assert breaker.failure(now, "again") is not None
    assert breaker.wait_s == 1.0
    assert breaker.retry_at == now + 1.0


def test_one_line_per_outage_however_many_calls():
    breaker = CircuitBreaker(first_wait_s=0.5, max_wait_s=4.0)
    lines = []
    now = 0.0
    for outage in range(3):
        for _ in range(50):
            now += 0.1
            if breaker.allow(now):
                lines.append(breaker.failure(now, f"outage {outage}"))
            else:
                assert breaker.state != CLOSED
        now += 10.0
        assert breaker.allow(now)
        lines.append(breaker.success(now))
        assert breaker.success(now) is None  # already closed: no line
    said = [line for line in lines if line]
    assert len(said) == 6
    assert [("down" in line, "back" in line) for line in said] == [
        (True, False),
        (False, True),
    ] * 3
    assert breaker.state == CLOSED


def test_a_failure_from_before_the_tier_came_back_is_ignored():
    """A put that was out when the old master died, and fails only after the
    breaker closed again, says nothing about the new master."""
    breaker = CircuitBreaker(first_wait_s=1.0, max_wait_s=30.0)
    assert breaker.failure(10.0, "down") is not None
    assert breaker.allow(11.5)
    assert breaker.success(11.6) is not None
    assert breaker.failure(11.7, "stale -900", started=9.0) is None
    assert breaker.state == CLOSED
    assert breaker.failure(11.8, "fresh -900", started=11.65) is not None
    assert breaker.state == OPEN
