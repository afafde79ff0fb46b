"""What loads and compute cost on this worker: the load policy's measurements.

Runs in: every Worker process, on the forward thread. The samples go to the
scheduler in the worker metadata of each step (connector/scheduler/load_policy.py
decides there).

    CostMeter.step_started / step_ended - a step's compute time on the
                     device's own clock (timing events on the compute stream),
                     for steps that load nothing: their time is all compute
    CostMeter.load_started / load_done - a load's seconds and its bytes from
                     the page cache and from disk (the store's read counters
                     before and after it)
    CostMeter.take() - the samples completed since the last call
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)

#: steps whose events are still pending are dropped past this many (a device
#: that never completes them must not grow the list)
_MAX_PENDING = 64
_DISK_COUNTERS = ("direct_read_bytes", "streamed_read_bytes")


def read_bytes(stores: Sequence[KVStore]) -> tuple[int, int]:
    """(bytes read from the page cache, bytes read from disk) so far, over
    ``stores``: buffered reads of mostly cached ranges against O_DIRECT and
    streamed reads (the store reader's counters)."""
    cached = disk = 0
    for store in stores:
        counters = store.counters.snapshot()
        cached += counters.get("cached_read_bytes", 0)
        disk += sum(counters.get(key, 0) for key in _DISK_COUNTERS)
    return cached, disk


class CostMeter:
    """Samples of load and compute cost; see the module docstring."""

    def __init__(self, backend: Any, stores: Sequence[KVStore]) -> None:
        self._backend = backend
        self._stores = stores
        self._step: tuple[Any, int] | None = None  # (start event, tokens)
        self._pending: list[tuple[Any, Any, int]] = []
        self._loads: list[tuple[float, int, int]] = []
        self._broken = False  # events without timing: measure no steps

    def step_started(self, tokens: int, loads: bool) -> None:
        self._step = None
        if loads or tokens <= 0 or self._broken:
            return
        try:
            start = self._backend.new_event(timing=True)
            start.record(self._backend.current_stream())
            self._step = (start, tokens)
        except Exception:
            self._give_up()

    def step_ended(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        try:
            end = self._backend.new_event(timing=True)
            end.record(self._backend.current_stream())
        except Exception:
            self._give_up()
            return
        self._pending.append((step[0], end, step[1]))
        del self._pending[:-_MAX_PENDING]

    def load_started(self) -> tuple[int, int]:
        """The read counters a load's :meth:`load_done` subtracts."""
        return read_bytes(self._stores)

    def load_done(self, before: tuple[int, int], seconds: float) -> None:
        cached, disk = read_bytes(self._stores)
        cached -= before[0]
        disk -= before[1]
        if cached + disk > 0:
            self._loads.append((seconds, cached, disk))

    def take(self) -> tuple[list[tuple[float, int, int]], list[tuple[float, int]]]:
        loads, self._loads = self._loads, []
        steps = []
        still = []
        for start, end, tokens in self._pending:
            try:
                if not end.query():
                    still.append((start, end, tokens))
                    continue
                steps.append((start.elapsed_ms(end) / 1e3, tokens))
            except Exception:
                self._give_up()
                return loads, []
        self._pending = still
        return loads, steps

    def _give_up(self) -> None:
        if not self._broken:
            self._broken = True
            self._pending = []
            logger.warning(
                "npukv_store: cannot time steps on this device; the load policy "
                "prices recompute without measurements (it loads every hit)",
                exc_info=True,
            )
