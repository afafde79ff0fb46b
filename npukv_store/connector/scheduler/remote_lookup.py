"""The scheduler's questions to the remote tier, within one step's budget.

Runs in: the EngineCore process, on the scheduler's thread.

A local miss asks the tier (``batch_is_exist`` on its own thread) how far the
prompt's chain goes on. All the lookups of one scheduling step together wait
at most ``remote_timeout_ms``; an answer not back by then makes the request
"ask again later" (``None`` to vLLM, which keeps it waiting one more step) for
up to ``GIVE_UP_STEPS`` steps, and then it is served with its local hit only.
While the tier's circuit breaker is open no one waits at all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from npukv_store.remote.tier import MooncakeTier

#: steps a request may be held back for a remote answer still out
GIVE_UP_STEPS = 3


class RemoteLookup:
    def __init__(self, tier: MooncakeTier, timeout_ms: float) -> None:
        self.tier = tier
        self.budget_s = timeout_ms / 1e3
        self._left_s = self.budget_s
        self._held: dict[str, int] = {}  # request -> steps it was held back
        #: the longest time one step spent here (bench_remote reads it)
        self.step_s = 0.0
        self.max_step_s = 0.0
        self.longest_s = 0.0  # over the whole run (logged at close)

    def new_step(self) -> None:
        """A scheduling step ends (build_connector_meta): a fresh budget."""
        self.max_step_s = max(self.max_step_s, self.step_s)
        self.step_s = 0.0
        self._left_s = self.budget_s

    def extend(
        self, req_id: str, chains: Sequence[tuple[bytes, Sequence[bytes]]]
    ) -> int | None:
        """How many leading blocks every chain ``(fingerprint, keys)`` has in
        the tier; None: ask again in the next step."""
        began = time.perf_counter()
        found: int | None = min(len(keys) for _, keys in chains) if chains else 0
        try:
            for fingerprint, keys in chains:
                if not found:
                    break
                wait = max(0.0, self._left_s - (time.perf_counter() - began))
                count = self.tier.lookup(fingerprint, keys[:found], wait)
                if count is None:
                    found = None
                    break
                found = min(found, count)
        finally:
            spent = time.perf_counter() - began
            self._left_s -= spent
            self.step_s += spent
        if found is None:
            held = self._held.get(req_id, 0)
            if held < GIVE_UP_STEPS:
                self._held[req_id] = held + 1
                return None
            found = 0
        self._held.pop(req_id, None)
        return found

    def take_max_step_s(self) -> float:
        """The longest step's time here since the last call."""
        longest = max(self.max_step_s, self.step_s)
        self.max_step_s = 0.0
        self.longest_s = max(self.longest_s, longest)
        return longest

    def forget(self, req_id: str) -> None:
        self._held.pop(req_id, None)
