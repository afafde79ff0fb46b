"""The remote tier's client: Mooncake Store behind the local store.

Runs in: any process of the connector (the scheduler's and the workers'); one
:class:`MooncakeTier` per process and master (:func:`open_tier`), shared by
the scheduler and worker sides when they live in one process. Every call to
Mooncake runs on one of the tier's own threads:

    npukv-remote-ctl  setup, the scheduler's lookups (batch_is_exist), health
    npukv-remote-put  puts from the staging ring (batch_put_from_multi_buffers)
    npukv-remote-get  loads into the caller's host buffer (batch_get_into)

because a Mooncake call against a dead master blocks for 3-4.5 s (measured:
put 4.27 s, setup 4.57 s, close 7.4 s) and the callers must not: the scheduler
waits at most its step's budget, a load at most a deadline sized by its bytes,
and a put never blocks anyone (it holds its ring region until it returns).
A :class:`~.breaker.CircuitBreaker` stops calls while the master is down and
probes it with one ``get_size`` per wait; setup is retried the same way, so a
tier started before its master comes up by itself (docs/decisions/0055).
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

from npukv_store import native
from npukv_store.config import StoreConfig
from npukv_store.remote.breaker import CircuitBreaker
from npukv_store.remote.value import ValueLayout, remote_key, verify_value
from npukv_store.spec import NamespaceSpec

logger = logging.getLogger(__name__)

#: Mooncake's return codes met on this path (mooncake-store's ErrorCode)
MISSING = -704  # OBJECT_NOT_FOUND
NO_SPACE = -200  # the segments cannot hold the put (no eviction)
RPC_FAIL = -900  # the master did not answer
#: a call that has not returned after this long is a dead master
STALL_S = 1.0
#: a key whose presence was seen is trusted this long by lookups (its bytes
#: are still verified when loaded: a vanished value is a miss then)
PRESENT_TTL_S = 5.0
#: puts waiting beyond this many batches are dropped (each holds ring space)
MAX_QUEUED_PUTS = 8
_SENTINEL = "npukv/health"
_MAX_PENDING = 1024
_MAX_PRESENT = 1 << 18

Pieces = list[list[tuple[int, int]]]  # per key: (address, bytes) in value order


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


class MooncakeTier:
    """One process's client of a Mooncake master; see the module docstring.

    Args:
        config: the ``remote_store``, ``mooncake_*`` and ``remote_timeout_ms`` keys.
        client_factory: makes the Mooncake client (tests pass a fake).
    """

    def __init__(
        self, config: StoreConfig, client_factory: Callable[[], Any] | None = None
    ) -> None:
        self.config = config
        self.counters = Counters()
        self.breaker = CircuitBreaker()
        self._factory = client_factory or _mooncake_client
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
        self._puts_lock = threading.Lock()
        self._closed = False
        self._ctl.submit(self._connect)

    # -- state ---------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self._client is not None and self.breaker.up

    def _usable(self) -> bool:
        """Whether calls may be made now; while the breaker is open, the one
        probe it allows is sent to the master (health or setup) instead."""
        if self._closed:
            return False
        self._check_stall()
        if self.breaker.up:  # no client yet: the first setup is still out
            return self._client is not None
        if self.breaker.allow(time.monotonic()):
            self._ctl.submit(self._connect if self._client is None else self._health)
        return False

    def _check_stall(self) -> None:
        """A control or put call still out after STALL_S is a dead master (a
        load has its own deadline); each stuck call counts once."""
        now = time.monotonic()
        for name, since in list(self._busy_since.items()):
            if name == "get" or now - since <= STALL_S:
                continue
            if self._stalled.get(name) != since:
                self._stalled[name] = since
                self._failed(f"a {name} call has not returned in {now - since:.1f} s")

    def _failed(self, reason: str) -> None:
        self.counters.add(remote_failures=1)
        line = self.breaker.failure(time.monotonic(), reason)
        if line:
            logger.warning("npukv_store: %s", line)

    def _worked(self) -> None:
        line = self.breaker.success(time.monotonic())
        if line:
            logger.warning("npukv_store: %s", line)

    def _call(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one Mooncake call, timing it for the stall check."""
        self._busy_since[name] = time.monotonic()
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
        if self._factory is _mooncake_client and not _master_listens(
            config.mooncake_master
        ):
            self._failed(f"master {config.mooncake_master} refuses connections")
            return
        try:
            client = self._factory()
            rc = self._call("setup", lambda: client.setup(
                _local_hostname(config), config.mooncake_metadata,
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
            self._failed(f"get_size returned {rc}")

    def _probe(self, names: list[str]) -> int:
        """Leading ``names`` present (ctl thread); 0 on any error."""
        client = self._client
        if client is None or not self.breaker.up:
            return 0
        found = self._call("batch_is_exist", lambda: client.batch_is_exist(names))
        if any(code < 0 for code in found) or len(found) != len(names):
            self._failed(f"batch_is_exist returned {sorted(set(found))}")
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
        names = [remote_key(fingerprint, key) for key in keys]
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

    def offer_blocks(
        self,
        spec: NamespaceSpec,
        fingerprint: bytes,
        keys: Sequence[bytes],
        pieces: Pieces,
        release: Callable[[], None],
    ) -> bool:
        """Put blocks whose bytes sit in registered memory (``pieces``: per
        key, its checksums then every tensor's row, in value order),
        asynchronously; ``release`` is called once they are no longer read.
        False (and ``release`` called now): dropped, counted."""
        layout = ValueLayout.for_spec(spec)
        with self._puts_lock:
            take = self._usable() and self._queued_puts < MAX_QUEUED_PUTS
            if take:
                self._queued_puts += 1
        if not take:
            self.counters.add(remote_put_dropped=len(keys))
            release()
            return False
        self._put.submit(
            self._put_batch, fingerprint, layout, tuple(keys), pieces, release
        )
        return True

    def _put_batch(
        self,
        fingerprint: bytes,
        layout: ValueLayout,
        keys: tuple[bytes, ...],
        pieces: Pieces,
        release: Callable[[], None],
    ) -> None:
        """Put thread: lay the values out whole in the registered staging
        buffer (one batched native copy out of the ring, which is then
        released), then one ``batch_put_from``. Mooncake's multi-buffer puts
        and gets would read the pieces in place, but on this version they
        fail at scale: 256 values of 9 pieces gave -800 (TRANSFER_FAIL) for
        some keys, then a call hung 60 s and left the client failing every
        transfer after (docs/decisions/0055)."""
        try:
            client = self._client
            if client is None or not self.breaker.up or self._closed:
                self.counters.add(remote_put_dropped=len(keys))
                self._done_put(release)
                return
            staging = self._staging(len(keys) * layout.value_bytes)
            _lay_out_values(staging, layout, fingerprint, keys, pieces)
        except Exception:
            self.counters.add(remote_put_failed=len(keys))
            logger.warning("npukv_store: a remote put failed", exc_info=True)
            self._done_put(release)
            return
        self._done_put(release, count=False)  # the ring is no longer read
        try:
            size = layout.value_bytes
            base = staging.ctypes.data
            names = [remote_key(fingerprint, key) for key in keys]
            ptrs = [base + i * size for i in range(len(keys))]
            codes = self._call(
                "put", lambda: client.batch_put_from(names, ptrs, [size] * len(keys))
            )
            stored = sum(1 for c in codes if c == 0)
            full = sum(1 for c in codes if c == NO_SPACE)
            self.counters.add(
                remote_put_blocks=stored,
                remote_put_bytes=stored * size,
                remote_put_full=full,
                remote_put_failed=len(codes) - stored - full,
            )
            if RPC_FAIL in codes:
                self._failed(f"batch_put_from returned {RPC_FAIL}")
            elif stored:
                self._worked()
        except Exception:
            self.counters.add(remote_put_failed=len(keys))
            logger.warning("npukv_store: a remote put failed", exc_info=True)
        finally:
            with self._puts_lock:
                self._queued_puts -= 1

    def _done_put(self, release: Callable[[], None], *, count: bool = True) -> None:
        """Give the ring region back (and, ``count``, end the put)."""
        try:
            release()  # before the count drops: drain() waits for it
        finally:
            if count:
                with self._puts_lock:
                    self._queued_puts -= 1

    def _staging(self, nbytes: int) -> np.ndarray:
        """The put thread's registered buffer of whole values (grow-only)."""
        staging = self._put_buffer
        if staging.nbytes < nbytes:
            if staging.nbytes:
                self.unregister(staging.ctypes.data)
            staging = self._put_buffer = np.empty(nbytes, dtype=np.uint8)
            self.register(staging.ctypes.data, staging.nbytes)
        return staging[:nbytes]

    # -- worker: loads ---------------------------------------------------------------

    def fetch(
        self,
        fingerprint: bytes,
        layout: ValueLayout,
        keys: Sequence[bytes],
        out: np.ndarray,
    ) -> FetchResult:
        """Read the values of ``keys`` into ``out`` (uint8 ``[n, value_bytes]``,
        registered with :meth:`register`) and verify each; waits at most a
        deadline sized by the bytes. A miss, a corrupt value or an error is
        ``ok[i] = False`` (recomputed), never an exception."""
        count = len(keys)
        failed = FetchResult([False] * count)
        if not count or not self._usable():
            return failed
        client = self._client
        size = layout.value_bytes
        names = [remote_key(fingerprint, key) for key in keys]
        base = out.ctypes.data
        ptrs = [base + i * size for i in range(count)]
        future = self._get.submit(
            self._call,
            "get",
            lambda: client.batch_get_into(names, ptrs, [size] * count),
        )
        # 0.25 s plus the bytes at 100 MB/s: far beyond a working master's
        # time (1.1-1.4 GB/s on loopback here), far below a dead one's 3-4.5 s
        deadline = 0.25 + count * size / 100e6
        try:
            codes = future.result(timeout=deadline)
        except FutureTimeout:
            self._failed(f"batch_get_into did not return in {deadline:.2f} s")
            self.counters.add(remote_load_errors=count)
            return FetchResult([False] * count, abandoned=True)
        except Exception as exc:
            self._failed(f"batch_get_into raised {exc!r}")
            self.counters.add(remote_load_errors=count)
            return failed
        ok = [False] * count
        whys = self._verify(layout, fingerprint, keys, out, codes)
        missing = corrupt = errors = 0
        for i, code in enumerate(codes):
            why = ""
            if code == size:
                why = whys[i]
                ok[i] = not why
            elif code == MISSING:
                missing += 1
            elif code >= 0:  # a value of another size is not ours either
                why = f"{code} bytes, expected {size}"
            else:
                errors += 1
            if why:
                corrupt += 1
                self._warn_corrupt(names[i], why)
        if RPC_FAIL in codes:
            self._failed(f"batch_get_into returned {RPC_FAIL}")
        else:
            self._worked()
        good = sum(ok)
        self.counters.add(
            remote_load_blocks=good,
            remote_load_bytes=good * size,
            remote_load_missing=missing,
            remote_load_corrupt=corrupt,
            remote_load_errors=errors,
        )
        return FetchResult(ok)

    def _verify(
        self,
        layout: ValueLayout,
        fingerprint: bytes,
        keys: Sequence[bytes],
        out: np.ndarray,
        codes: Sequence[int],
    ) -> list[str]:
        """verify_value of every value that arrived whole, on two threads
        (the hashing releases the GIL): 256 values of 512 KiB took 16-18 ms
        on one thread here, 12-13 ms on two, against about 90 ms to get them."""
        whys = [""] * len(keys)
        size = layout.value_bytes

        def check(indices: range) -> None:
            for i in indices:
                if codes[i] == size:
                    whys[i] = verify_value(layout, fingerprint, keys[i], out[i])

        half = (len(keys) + 1) // 2
        if len(keys) < 8:
            check(range(len(keys)))
        else:
            second = self._verifier.submit(check, range(half, len(keys)))
            check(range(half))
            second.result()
        return whys

    def _warn_corrupt(self, name: str, why: str) -> None:
        logger.warning(
            "npukv_store: remote value %s is not the block asked for (%s); "
            "recomputing it", name, why,
        )  # fmt: skip

    # -- lifecycle ---------------------------------------------------------------------

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until the puts offered so far have returned."""
        end = time.monotonic() + timeout_s
        while self._queued_puts > 0:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True

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
                target=client.close, name="npukv-remote-close", daemon=True
            ).start()


_TIERS: dict[tuple[str, str, str], MooncakeTier] = {}
_USERS: dict[int, int] = {}  # id(tier) -> open_tier calls not yet released
_TIERS_LOCK = threading.Lock()


def open_tier(config: StoreConfig) -> MooncakeTier | None:
    """This process's tier for ``config``'s master (one per master, shared by
    the connector's sides; give it back with :func:`release_tier`); None when
    ``remote_store`` is ``none``."""
    if config.remote_store == "none":
        return None
    missing = mooncake_missing()
    if missing is not None:
        logger.error("npukv_store: the remote tier is off: %s", missing)
        return None
    key = (config.mooncake_master, config.mooncake_metadata, config.mooncake_protocol)
    with _TIERS_LOCK:
        tier = _TIERS.get(key)
        if tier is None or tier._closed:
            tier = _TIERS[key] = MooncakeTier(config)
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


def _lay_out_values(
    staging: np.ndarray,
    layout: ValueLayout,
    fingerprint: bytes,
    keys: Sequence[bytes],
    pieces: Pieces,
) -> None:
    """Write the whole value of every key into ``staging`` (value-major):
    its prefix, then its pieces (checksums and rows) copied in one native
    call, GIL released."""
    size = layout.value_bytes
    values = staging.reshape(len(keys), size)
    prefix_bytes = len(layout.prefix(fingerprint, b"\0" * 16))
    values[:, :prefix_bytes] = np.frombuffer(
        b"".join(layout.prefix(fingerprint, key) for key in keys), np.uint8
    ).reshape(len(keys), prefix_bytes)
    src, dst, sizes = [], [], []
    base = staging.ctypes.data
    for i, key_pieces in enumerate(pieces):
        offset = base + i * size + prefix_bytes
        for address, nbytes in key_pieces:
            src.append(address)
            dst.append(offset)
            sizes.append(nbytes)
            offset += nbytes
        if offset != base + (i + 1) * size:
            raise ValueError(
                f"pieces of key {i}: found {offset - base - i * size} bytes, "
                f"expected {size}"
            )
    native.copy_ptrs(
        np.array(src, np.int64), np.array(dst, np.int64), np.array(sizes, np.int64)
    )


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


def _mooncake_client() -> Any:
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()


def _local_hostname(config: StoreConfig) -> str:
    """The address this client advertises to the others: the master's host
    when it is loopback (one machine), else this host's name."""
    host = config.mooncake_master.rpartition(":")[0]
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return os.environ.get("MC_LOCAL_HOSTNAME") or _hostname()


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _master_listens(address: str, timeout_s: float = 0.5) -> bool:
    """Whether the master's RPC port takes a TCP connection. Asked before each
    setup: Mooncake's setup() holds the GIL, so the whole process stops for
    the ~4.5 s it takes to fail against no master (measured; close() too)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout_s):
            return True
    except (OSError, ValueError):
        return False
