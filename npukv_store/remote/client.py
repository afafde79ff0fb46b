"""Mooncake's client as the remote tier uses it: return codes, counters,
making a client, and where it connects.

Runs in: any process of the connector. Imports mooncake only when a client is
made (:func:`new_client`) or asked for (:func:`mooncake_missing`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent.futures import Future
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.errors import ConfigError
from npukv_store.keying import RemoteKeys, remote_keys_for

logger = logging.getLogger(__name__)

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
    ``out``, which the caller must not reuse until ``pending`` (that call)
    is done."""

    __slots__ = ("abandoned", "ok", "pending")

    def __init__(
        self,
        ok: list[bool],
        abandoned: bool = False,
        pending: Future[Any] | None = None,
    ) -> None:
        self.ok = ok
        self.abandoned = abandoned
        self.pending = pending


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


_NO_SECRET = (
    "remote_store is {store} but remote_secret_file is not set: without a "
    "secret any host that reaches Mooncake could read, forge and remove the KV "
    "cache. Set remote_secret_file to a file of at least 32 random bytes "
    "(chmod 600) shared by the tier's nodes, or remote_insecure: true to run "
    "the tier without one"
)


def tier_keys(config: StoreConfig) -> RemoteKeys:
    """The tier's keys from ``config``; ConfigError when it may not run."""
    keys = remote_keys_for(
        config.remote_store, config.remote_secret_file, config.remote_insecure
    )
    if keys is None:
        raise ConfigError(_NO_SECRET.format(store=config.remote_store))
    return keys


_SAID: set[str] = set()  # why a tier was refused: said once per process
_SAID_LOCK = threading.Lock()


def tier_off(reason: str) -> None:
    """Log why the tier is off: one ERROR per reason and process (both sides
    of the connector ask for the tier)."""
    with _SAID_LOCK:
        if reason in _SAID:
            return
        _SAID.add(reason)
    logger.error("npukv_store: the remote tier is off: %s", reason)


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
