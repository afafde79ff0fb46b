"""A circuit breaker for the remote tier: stop asking a master that is down.

Runs in: any thread (one lock). Pure: the clock is passed in.

    closed    - every call is made; a failure opens it
    open      - no call is made until ``retry_at``; then one probe is allowed
    half_open - that probe is out; its success closes, its failure reopens
                with the wait doubled (up to ``max_wait_s``)

Each change of state returns one line for the log, so a dead master costs one
warning when it goes and one when it comes back, never one per call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    first_wait_s: float = 1.0
    max_wait_s: float = 30.0
    state: str = CLOSED
    wait_s: float = 0.0
    retry_at: float = 0.0
    reason: str = ""
    closed_at: float = 0.0  # when it last closed (or was made)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def allow(self, now: float) -> bool:
        """Whether a call may be made now (open: only the one probe after the
        wait, which moves it to half-open)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and now >= self.retry_at:
                self.state = HALF_OPEN
                return True
            return False

    def success(self, now: float) -> str | None:
        """A call worked; returns the log line when this closes the breaker."""
        with self._lock:
            if self.state == CLOSED:
                return None
            self.state, self.wait_s, self.reason = CLOSED, 0.0, ""
            self.closed_at = now
            return "remote tier is back: asking it again"

    def failure(
        self, now: float, reason: str, started: float | None = None
    ) -> str | None:
        """A call failed (or hung); returns the log line only when this opens
        the breaker from closed (a failed probe doubles the wait, silently).
        A call ``started`` before the breaker last closed tells nothing about
        the master it found since (a put out when the old one died): ignored."""
        with self._lock:
            was = self.state
            if was == CLOSED and started is not None and started < self.closed_at:
                return None
            self.wait_s = (
                self.first_wait_s
                if was == CLOSED
                else min(self.max_wait_s, max(self.wait_s, self.first_wait_s) * 2)
            )
            self.state, self.retry_at, self.reason = OPEN, now + self.wait_s, reason
            if was == CLOSED:
                return (
                    f"remote tier is down ({reason}); serving from the local "
                    f"store only, retrying in {self.wait_s:.0f} s"
                )
            return None

    @property
    def up(self) -> bool:
        return self.state == CLOSED
