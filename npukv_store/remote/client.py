"""Mooncake's client as the remote tier uses it: return codes, counters,
making a client, and where it connects.

Runs in: any process of the connector. Imports mooncake only when a client is
made (:func:`new_client`) or asked for (:func:`mooncake_missing`).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from npukv_store.config import StoreConfig

#: Mooncake's return codes met on this path (mooncake-store's ErrorCode)
MISSING = -704  # OBJECT_NOT_FOUND
NO_SPACE = -200  # the segments cannot hold the put (no eviction)
RPC_FAIL = -900  # the master did not answer


class Counters:
    """Thread-safe running totals (the connector reports their deltas)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, int] = {}

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, value in counts.items():
                self._data[key] = self._data.get(key, 0) + value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._data)


class FetchResult:
    """A load's outcome: ``ok[i]`` says value i in ``out`` is verified;
    ``abandoned``: the call did not return in time and may still write into
    ``out``, which the caller must not reuse."""

    __slots__ = ("abandoned", "ok")

    def __init__(self, ok: list[bool], abandoned: bool = False) -> None:
        self.ok = ok
        self.abandoned = abandoned


def mooncake_missing() -> str | None:
    """Why the Mooncake client cannot be imported here; None when it can."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        return (
            f"mooncake.store cannot be imported ({exc}); expected the wheel "
            "mooncake-transfer-engine-non-cuda==0.3.13.post1 (or -npu on Ascend) "
            "and libibverbs1 (scripts/setup_env.sh installs both)"
        )
    return None


def new_client() -> Any:
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()


def local_hostname(config: StoreConfig) -> str:
    """The address this client advertises to the others: the master's host
    when it is loopback (one machine), else this host's name."""
    host = config.mooncake_master.rpartition(":")[0]
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return os.environ.get("MC_LOCAL_HOSTNAME") or socket.gethostname()


def master_listens(address: str, timeout_s: float = 0.5) -> bool:
    """Whether the master's RPC port takes a TCP connection. Asked before each
    setup: Mooncake's setup() holds the GIL, so the whole process stops for
    the ~4.5 s it takes to fail against no master (measured; close() too)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout_s):
            return True
    except (OSError, ValueError):
        return False
