"""The remote tier's client: Mooncake Store behind the local store.

Runs in: any process of the connector (the scheduler's and the workers'); one
:class:`MooncakeTier` per process and master (:func:`open_tier`), shared by
the scheduler and worker sides when they live in one process. Every call to
Mooncake runs on one of the tier's own threads:

    npukv-remote-ctl  setup, the scheduler's lookups (batch_is_exist), health
    npukv-remote-put  puts of what the ring published (copied out, batch_put_from)
    npukv-remote-get  loads into the caller's host buffer (batch_get_into)

because a Mooncake call against a dead master blocks for 3-4.5 s (measured:
put 4.27 s, setup 4.57 s, close 7.4 s) and the callers must not: the scheduler
waits at most its step's budget, a load at most a deadline sized by its bytes,
and a put never blocks anyone (it holds its ring region only until it has
copied the values out). ``setup`` and ``close`` hold the GIL while they run
(4.5 s and 2-20 s without a master): setup is only tried once the master's
port takes a connection, and close runs at shutdown.
A :class:`~.breaker.CircuitBreaker` stops calls while the master is down and
probes it with one ``get_size`` per wait; setup is retried the same way, so a
tier started before its master comes up by itself (docs/decisions/0055). A
get abandoned at its deadline holds the tier down until it returns.

Every key name and value is keyed with the tier's secret
(:class:`~npukv_store.keying.RemoteKeys`, from ``remote_secret_file``): a
tier without one does not start unless ``remote_insecure`` says so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from npukv_store.config import StoreConfig
from npukv_store.errors import ConfigError
from npukv_store.keying import RemoteKeys
from npukv_store.remote.breaker import CircuitBreaker
from npukv_store.remote.client import (
    MISSING,
    Counters,
    local_hostname,
    master_listens,
    mooncake_missing,
    new_client,
    tier_keys,
    tier_off,
)
from npukv_store.remote.transfers import TransfersMixin
from npukv_store.remote.value import remote_keys

logger = logging.getLogger(__name__)

#: a call that has not returned after this long is a dead master
STALL_S = 1.0
#: a key whose presence was seen is trusted this long by lookups (its bytes
#: are still verified when loaded: a vanished value is a miss then)
PRESENT_TTL_S = 5.0
#: how long close waits for calls still inside the client
CLOSE_WAIT_S = 10.0
_SENTINEL = "npukv/health"
_MAX_PENDING = 1024
_MAX_PRESENT = 1 << 18


class MooncakeTier(TransfersMixin):
    """One process's client of a Mooncake master; see the module docstring.

    Args:
        config: the ``remote_store``, ``mooncake_*``, ``remote_secret_file``,
            ``remote_insecure`` and ``remote_timeout_ms`` keys.
        client_factory: makes the Mooncake client (tests pass a fake).
        keys: the tier's name and MAC keys; by default derived from
            ``config`` (:func:`~npukv_store.keying.remote_keys_for`).

    Raises:
        ConfigError: no usable secret (see :func:`open_tier`, which says so
            in the log instead).
    """

    def __init__(
        self,
        config: StoreConfig,
        client_factory: Callable[[], Any] | None = None,
        keys: RemoteKeys | None = None,
    ) -> None:
        self.config = config
        self.keys = keys or tier_keys(config)
        if self.keys.insecure:
            logger.warning(
                "npukv_store: the remote tier runs with remote_insecure: any host "
                "that reaches Mooncake %s can read, forge and remove the KV cache "
                "(set remote_secret_file to a secret shared by the tier's nodes)",
                config.mooncake_master,
            )
        self.counters = Counters()
        self.breaker = CircuitBreaker()
        self._factory = client_factory or new_client
        self._client: Any = None
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # address -> bytes, with Mooncake
        self._present: dict[str, float] = {}  # key -> seen until (monotonic)
        self._pending: dict[tuple[str, int], tuple[Future[int], float]] = {}
        self._ctl = ThreadPoolExecutor(1, thread_name_prefix="npukv-remote-ctl")
        self._put = ThreadPoolExecutor(1, thread_name_prefix="npukv-remote-put")
        self._get = ThreadPoolExecutor(1, thread_name_prefix="npukv-remote-get")
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="npukv-remote-verify")
        self._queued_puts = 0
        self._put_buffer = np.empty(0, dtype=np.uint8)
        self._busy_since: dict[str, float] = {}  # call -> when it began
        self._stalled: dict[str, float] = {}  # call -> the start counted as stuck
        self._began: dict[str, float] = {}  # call -> when it last began
        self._stuck_get: Future[Any] | None = None  # abandoned, not returned yet
        self._bad_values: dict[str, int] = {}  # see TransfersMixin._bad_value
        self._puts_lock = threading.Lock()
        self._closed = False
        self._ctl.submit(self._connect)

    # -- state ---------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self._client is not None and self.breaker.up and not self._get_stuck()

    def _usable(self) -> bool:
        """Whether calls may be made now; while the breaker is open, the one
        probe it allows is sent to the master (health or setup) instead.
        Nothing is sent while an abandoned get is still out: the breaker
        stays open (no probe closes it) until that call returns."""
        if self._closed or self._get_stuck():
            return False
        self._check_stall()
        if self.breaker.up:  # no client yet: the first setup is still out
            return self._client is not None
        if self.breaker.allow(time.monotonic()):
            self._ctl.submit(self._connect if self._client is None else self._health)
        return False

    def _check_stall(self) -> None:
        """A control or put call still out after STALL_S is a dead master (a
        load has its own deadline, and one past it holds the tier down:
        _get_stuck); each stuck call counts once."""
        now = time.monotonic()
        for name, since in list(self._busy_since.items()):
            if name == "get" or now - since <= STALL_S:
                continue
            if self._stalled.get(name) != since:
                self._stalled[name] = since
                self._failed(
                    f"a {name} call has not returned in {now - since:.1f} s", since
                )

    def _failed(self, reason: str, started: float | None = None) -> None:
        self.counters.add(remote_failures=1)
        line = self.breaker.failure(time.monotonic(), reason, started)
        if line:
            logger.warning("npukv_store: %s", line)

    def _worked(self) -> None:
        line = self.breaker.success(time.monotonic())
        if line:
            logger.warning("npukv_store: %s", line)

    def _call(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one Mooncake call, timing it for the stall check; its start is
        kept in ``_began[name]`` for _failed."""
        self._busy_since[name] = self._began[name] = time.monotonic()
        try:
            return fn()
        finally:
            self._busy_since.pop(name, None)

    # -- ctl thread ------------------------------------------------------------------

    def _connect(self) -> None:
        """Set the client up (ctl thread); a failure opens the breaker, whose
        next allowed probe tries again."""
        if self._client is not None or self._closed:
            return
        config = self.config
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # not 90 s
        if self._factory is new_client and not master_listens(config.mooncake_master):
            self._failed(f"master {config.mooncake_master} refuses connections")
            return
        try:
            client = self._factory()
            rc = self._call("setup", lambda: client.setup(
                local_hostname(config), config.mooncake_metadata,
                config.mooncake_segment_size, config.mooncake_local_buffer,
                config.mooncake_protocol, config.mooncake_device,
                config.mooncake_master,
            ))  # fmt: skip
        except Exception as exc:  # the library itself failed: keep trying later
            self._failed(f"setup raised {exc!r}")
            return
        if rc != 0:
            self._failed(f"setup against {config.mooncake_master} returned {rc}")
            return
        with self._lock:
            for address, nbytes in self._registered.items():
                client.register_buffer(address, nbytes)
            self._client = client
        line = self.breaker.success(time.monotonic())
        logger.info(
            "npukv_store: remote tier up: Mooncake master %s, %s, segment %d B%s",
            config.mooncake_master, config.mooncake_protocol,
            config.mooncake_segment_size, f" ({line})" if line else "",
        )  # fmt: skip

    def _health(self) -> None:
        client = self._client
        if client is None:
            return self._connect()
        rc = self._call("health", lambda: client.get_size(_SENTINEL))
        if rc == MISSING or rc >= 0:
            self._worked()
        else:
            self._failed(f"get_size returned {rc}", self._began.get("health"))

    def _probe(self, names: list[str]) -> int:
        """Leading ``names`` present (ctl thread); 0 on any error."""
        client = self._client
        if client is None or not self.breaker.up:
            return 0
        found = self._call("batch_is_exist", lambda: client.batch_is_exist(names))
        if any(code < 0 for code in found) or len(found) != len(names):
            self._failed(
                f"batch_is_exist returned {sorted(set(found))}",
                self._began.get("batch_is_exist"),
            )
            return 0
        self._worked()
        count = 0
        for code in found:
            if code != 1:
                break
            count += 1
        until = time.monotonic() + PRESENT_TTL_S
        for name in names[:count]:
            self._present[name] = until
        return count

    # -- scheduler: lookups ------------------------------------------------------------

    def lookup(
        self, fingerprint: bytes, keys: Sequence[bytes], wait_s: float
    ) -> int | None:
        """How many of ``keys`` (a chain's continuation) lead present in the
        tier, waiting at most ``wait_s`` for the master. None: not known yet
        (a probe is out; ask again). 0 while the tier is down."""
        if not keys or not self._usable():
            return 0
        names = remote_keys(fingerprint, keys, self.keys.name_key)
        now = time.monotonic()
        known = 0
        while known < len(names) and self._present.get(names[known], 0.0) > now:
            known += 1
        if known == len(names):
            return known
        probe_key = (names[known], len(names) - known)
        pending = self._pending.get(probe_key)
        if pending is None:
            self._trim(now)
            pending = (self._ctl.submit(self._probe, names[known:]), now)
            self._pending[probe_key] = pending
            self.counters.add(remote_lookups=1)
        future, _ = pending
        try:
            found = future.result(timeout=max(0.0, wait_s))
        except FutureTimeout:
            return None
        except Exception as exc:
            self._failed(f"batch_is_exist raised {exc!r}")
            found = 0
        self._pending.pop(probe_key, None)
        return known + found

    def _trim(self, now: float) -> None:
        """Bound the lookup caches: answers nobody asked for again, expired
        presences."""
        if len(self._pending) > _MAX_PENDING:
            for key, (future, _) in list(self._pending.items()):
                if future.done():
                    del self._pending[key]
        if len(self._present) > _MAX_PRESENT:
            self._present = {k: t for k, t in self._present.items() if t > now}

    # -- worker: puts from the staging ring -------------------------------------------

    def register(self, address: int, nbytes: int) -> None:
        """Register host memory that puts read from or loads write into (the
        ring, load buffers); kept across reconnects."""
        with self._lock:
            if self._registered.get(address) == nbytes:
                return
            self._registered[address] = nbytes
            client = self._client
            if client is not None:  # local bookkeeping only: no master call
                client.register_buffer(address, nbytes)

    def unregister(self, address: int) -> None:
        """Forget memory given to :meth:`register` (before it is freed)."""
        with self._lock:
            if self._registered.pop(address, None) is None:
                return
            client = self._client
            if client is not None:
                client.unregister_buffer(address)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the threads; queued puts are dropped (their regions
        released). Mooncake's own close (2 s, 7 s with the master down) runs
        on a daemon thread: a shutting-down server does not wait for it."""
        if self._closed:
            return
        self._closed = True
        # queued puts still run, see _closed and release their regions at once
        self._put.shutdown(wait=False)
        for pool in (self._get, self._ctl, self._verifier):
            pool.shutdown(wait=False, cancel_futures=True)
        client, self._client = self._client, None
        if client is not None:
            threading.Thread(
                target=self._close_client, args=(client,), name="npukv-remote-close",
                daemon=True,
            ).start()  # fmt: skip

    def _close_client(self, client: Any) -> None:
        """Close ``client`` once no call of ours is inside it: closing under a
        running call crashed the process (a get hung on a killed contributor).
        One still running after CLOSE_WAIT_S keeps the client open; the
        process's exit frees it."""
        end = time.monotonic() + CLOSE_WAIT_S
        while self._busy_since and time.monotonic() < end:
            time.sleep(0.01)
        if not self._busy_since:
            client.close()


_TIERS: dict[tuple[str, str, str, RemoteKeys], MooncakeTier] = {}
_USERS: dict[int, int] = {}  # id(tier) -> open_tier calls not yet released
_TIERS_LOCK = threading.Lock()


def open_tier(config: StoreConfig) -> MooncakeTier | None:
    """This process's tier for ``config``'s master and secret (one per
    master, shared by the connector's sides; give it back with
    :func:`release_tier`); None when ``remote_store`` is ``none``, and, with
    one ERROR line saying why, when Mooncake is missing or no secret is
    usable: the local store serves on alone."""
    if config.remote_store == "none":
        return None
    try:
        keys = tier_keys(config)
    except ConfigError as exc:
        tier_off(str(exc))
        return None
    missing = mooncake_missing()
    if missing is not None:
        tier_off(missing)
        return None
    key = (
        config.mooncake_master, config.mooncake_metadata, config.mooncake_protocol,
        keys,
    )  # fmt: skip
    with _TIERS_LOCK:
        tier = _TIERS.get(key)
        if tier is None or tier._closed:
            tier = _TIERS[key] = MooncakeTier(config, keys=keys)
        _USERS[id(tier)] = _USERS.get(id(tier), 0) + 1
        return tier


def release_tier(tier: MooncakeTier) -> None:
    """One user of ``tier`` is done; the last one closes it."""
    with _TIERS_LOCK:
        left = _USERS.get(id(tier), 1) - 1
        if left > 0:
            _USERS[id(tier)] = left
            return
        _USERS.pop(id(tier), None)
        for key, value in list(_TIERS.items()):
            if value is tier:
                del _TIERS[key]
    tier.close()
