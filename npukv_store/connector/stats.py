"""The connector's per-step statistics, in vLLM's KVConnectorStats shape.

Runs in: Worker and EngineCore processes (collected per step), the logger
process (aggregated and reduced by vLLM's KVConnectorLogging).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

#: every counter this connector reports; all are sums over steps and workers
COUNTERS = (
    "lookup_tokens",
    "hit_tokens",
    "loaded_blocks",
    "loaded_bytes",
    "load_seconds",
    "load_errors",
    "saved_blocks",
    "saved_bytes",
    "save_seconds",
    "skipped_blocks",
    "dropped_blocks",
    # admission (store/admission.py, docs/decisions/0069): blocks a save
    # brought that were not written, those brought again after being
    # declined, and written blocks evicted before any read
    "declined_blocks",
    "lost_hit_blocks",
    "wasted_write_blocks",
    # the load policy's decisions, one per hit it was asked about
    # (connector/scheduler/load_policy.py), and the hit tokens it chose to recompute
    "decided_load",
    "decided_shorter",
    "decided_recompute",
    "decided_probe",
    "declined_tokens",
    # the remote tier (npukv_store.remote; docs/metrics.md): the scheduler's
    # hits and lookups, the workers' puts and loads, and every failed call
    "remote_hit_tokens",
    "remote_lookups",
    "remote_failures",
    "remote_put_blocks",
    "remote_put_bytes",
    "remote_put_full",
    "remote_put_failed",
    "remote_put_dropped",
    "remote_load_blocks",
    "remote_load_bytes",
    "remote_load_missing",
    "remote_load_corrupt",
    "remote_load_mac_failed",
    "remote_load_errors",
)
#: the store's counters (StoreCounters) a worker reports as they grow
STORE_COUNTERS = (
    "dropped_blocks",
    "declined_blocks",
    "lost_hit_blocks",
    "wasted_write_blocks",
)
#: the tier's totals each side reports (one process may hold both sides and
#: one tier: each total is reported by one side only)
SCHEDULER_COUNTERS = ("remote_lookups", "remote_failures")
WORKER_COUNTERS = tuple(
    key
    for key in COUNTERS
    if key.startswith("remote_put") or key.startswith("remote_load")
)
#: gauges: the latest value, the largest over workers (a peak, not a sum over
#: steps); present only when it changed since the worker's last report
GAUGES = ("ring_used_bytes", "remote_up")
#: peaks: the largest over the steps and workers aggregated (the slowest
#: rank's wait is the step's wait; remote_wait_seconds: the longest a
#: scheduler step spent asking the remote tier)
PEAKS = ("load_wait_seconds", "remote_wait_seconds")


@dataclass
class NPUKVStats(KVConnectorStats):
    """Counters summed over steps and workers; ``reduce`` adds rates."""

    def __post_init__(self) -> None:
        for key in COUNTERS:
            self.data.setdefault(key, 0)

    def add(self, **counts: float) -> None:
        for key, value in counts.items():
            self.data[key] += value

    def reset(self) -> None:
        self.data = {key: 0 for key in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> NPUKVStats:
        for key in COUNTERS:
            self.data[key] += other.data.get(key, 0)
        for key in (*GAUGES, *PEAKS):
            if key in other.data:
                self.data[key] = max(self.data.get(key, 0), other.data[key])
        return self

    def reduce(self) -> dict[str, int | float]:
        data = self.data
        out: dict[str, int | float] = {k: data[k] for k in COUNTERS}
        out["load_GBps"] = _rate(data["loaded_bytes"], data["load_seconds"])
        out["save_GBps"] = _rate(data["saved_bytes"], data["save_seconds"])
        lookups = data["lookup_tokens"]
        out["hit_rate"] = round(data["hit_tokens"] / lookups, 4) if lookups else 0.0
        out.update({key: data[key] for key in (*GAUGES, *PEAKS) if key in data})
        return out

    def peak(self, key: str, value: float) -> None:
        self.data[key] = max(self.data.get(key, 0), value)

    def is_empty(self) -> bool:
        changed = any(key in self.data for key in (*GAUGES, *PEAKS))
        return not changed and not any(self.data.get(key) for key in COUNTERS)

    def to_dict(self) -> dict[str, Any]:
        """The payload vLLM hands its stat loggers: 0.32+ asks for it here,
        0.23 reads ``data`` itself (connector/vllm_api.py)."""
        return self.data

    def copy(self) -> NPUKVStats:
        return NPUKVStats(dict(self.data))

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> NPUKVStats:
        return cls(dict(data or {}))


def _rate(nbytes: float, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def remote_deltas(
    tier: Any, names: tuple[str, ...], reported: dict[str, int]
) -> dict[str, int]:
    """The growth of ``tier``'s totals ``names`` since the last call (which
    ``reported`` remembers)."""
    totals = tier.counters.snapshot()
    deltas = {}
    for name in names:
        now = totals.get(name, 0)
        if now != reported.get(name, 0):
            deltas[name] = now - reported.get(name, 0)
            reported[name] = now
    return deltas
