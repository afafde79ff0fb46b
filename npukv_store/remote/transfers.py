"""The remote tier's transfers: puts of what the staging ring published, and
loads into the caller's host buffer, each verified.

Runs in: the worker process; puts on the tier's ``npukv-remote-put`` thread,
loads' Mooncake calls on ``npukv-remote-get`` (the caller waits up to a
deadline), verification on the caller's thread and ``npukv-remote-verify``.
:class:`TransfersMixin` is the part of :class:`~.tier.MooncakeTier` that
moves bytes; the tier holds the client, the breaker and the threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from npukv_store import native
from npukv_store.keying import RemoteKeys
from npukv_store.remote.breaker import CircuitBreaker
from npukv_store.remote.client import MISSING, NO_SPACE, RPC_FAIL, Counters, FetchResult
from npukv_store.remote.value import (
    MAC_MISMATCH,
    SUMS_OFFSET,
    ValueLayout,
    remote_keys,
    verify_value,
)
from npukv_store.spec import NamespaceSpec

logger = logging.getLogger(__name__)

#: puts waiting beyond this many batches are dropped (each holds ring space)
MAX_QUEUED_PUTS = 8


def load_deadline_s(nbytes: int) -> float:
    """How long a load of ``nbytes`` waits for Mooncake: 0.5 s plus the bytes
    at 50 MB/s, far beyond a working master's time (0.8-1.7 GB/s on loopback
    here, page faults and a busy host included), and below a dead one's
    3-4.5 s for a load of a few MB."""
    return 0.5 + nbytes / 50e6


Pieces = list[list[tuple[int, int]]]  # per key: (address, bytes) in value order


class TransfersMixin:
    """Puts and loads of :class:`~.tier.MooncakeTier` (which sets these)."""

    _client: Any
    _closed: bool
    keys: RemoteKeys
    breaker: CircuitBreaker
    counters: Counters
    _puts_lock: threading.Lock
    _queued_puts: int
    _put: ThreadPoolExecutor
    _get: ThreadPoolExecutor
    _verifier: ThreadPoolExecutor
    _put_buffer: np.ndarray
    _began: dict[str, float]
    _stuck_get: Future[Any] | None
    _lock: threading.Lock
    _bad_values: dict[str, int]  # failure kind -> failures since it last warned

    def _usable(self) -> bool:
        raise NotImplementedError

    def _call(self, name: str, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def _failed(self, reason: str, started: float | None = None) -> None:
        raise NotImplementedError

    def _worked(self) -> None:
        raise NotImplementedError

    def register(self, address: int, nbytes: int) -> None:
        raise NotImplementedError

    def unregister(self, address: int) -> None:
        raise NotImplementedError

    # -- puts from the staging ring ----------------------------------------------

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
            _lay_out_values(staging, layout, fingerprint, keys, pieces, self.keys)
        except Exception:
            self.counters.add(remote_put_failed=len(keys))
            logger.warning("npukv_store: a remote put failed", exc_info=True)
            self._done_put(release)
            return
        self._done_put(release, count=False)  # the ring is no longer read
        try:
            size = layout.value_bytes
            base = staging.ctypes.data
            names = remote_keys(fingerprint, keys, self.keys.name_key)
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
                self._failed(f"batch_put_from returned {RPC_FAIL}", self._began["put"])
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

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until the puts offered so far have returned."""
        end = time.monotonic() + timeout_s
        while self._queued_puts > 0:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True

    # -- loads ---------------------------------------------------------------------

    def _get_stuck(self) -> bool:
        """Whether a get abandoned at its deadline has not returned yet. Its
        return is said once; the breaker's next probe then brings the tier
        back."""
        stuck = self._stuck_get
        if stuck is None:
            return False
        if not stuck.done():
            return True
        with self._lock:
            if self._stuck_get is not stuck:
                return False
            self._stuck_get = None
        logger.warning(
            "npukv_store: the abandoned batch_get_into returned after %.1f s; "
            "probing the remote tier again", time.monotonic() - self._began["get"],
        )  # fmt: skip
        return False

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
        ``ok[i] = False`` (recomputed), never an exception.

        A get past its deadline is abandoned (``abandoned``, with the call's
        future in ``pending``) and holds the tier down until it returns
        (:meth:`~.tier.MooncakeTier._usable`): the one get thread is stuck
        behind it, and every load sent after would be abandoned in turn,
        each keeping its caller's buffer."""
        count = len(keys)
        failed = FetchResult([False] * count)
        if not count or not self._usable():
            return failed
        client = self._client
        size = layout.value_bytes
        names = remote_keys(fingerprint, keys, self.keys.name_key)
        base = out.ctypes.data
        ptrs = [base + i * size for i in range(count)]
        future = self._get.submit(
            self._call,
            "get",
            lambda: client.batch_get_into(names, ptrs, [size] * count),
        )
        deadline = load_deadline_s(count * size)
        try:
            codes = future.result(timeout=deadline)
        except FutureTimeout:
            self._stuck_get = future  # before the breaker opens: no probe closes it
            self._failed(f"batch_get_into did not return in {deadline:.2f} s")
            self.counters.add(remote_load_errors=count)
            return FetchResult([False] * count, abandoned=True, pending=future)
        except Exception as exc:
            self._failed(f"batch_get_into raised {exc!r}")
            self.counters.add(remote_load_errors=count)
            return failed
        ok = [False] * count
        whys = self._verify(layout, fingerprint, keys, out, codes)
        missing = corrupt = forged = errors = verified = 0
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
                forged += why.startswith(MAC_MISMATCH)
                self._bad_value(names[i], why)
            elif ok[i]:
                verified += 1
        if verified and not corrupt:
            self._values_good()
        if RPC_FAIL in codes:
            self._failed(f"batch_get_into returned {RPC_FAIL}", self._began["get"])
        else:
            self._worked()
        good = sum(ok)
        self.counters.add(
            remote_load_blocks=good,
            remote_load_bytes=good * size,
            remote_load_missing=missing,
            remote_load_corrupt=corrupt,
            remote_load_mac_failed=forged,
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
        mac_key = self.keys.mac_key

        def check(indices: range) -> None:
            for i in indices:
                if codes[i] == size:
                    whys[i] = verify_value(
                        layout, fingerprint, keys[i], out[i], mac_key=mac_key
                    )

        half = (len(keys) + 1) // 2
        if len(keys) < 8:
            check(range(len(keys)))
        else:
            second = self._verifier.submit(check, range(half, len(keys)))
            check(range(half))
            second.result()
        return whys

    def _bad_value(self, name: str, why: str) -> None:
        """One WARNING for the first value of a kind (a MAC that fails, or
        any other mismatch) after a stretch of good loads; the others at
        DEBUG: whoever can put values in the tier must not flood the log."""
        kind = "mac" if why.startswith(MAC_MISMATCH) else "corrupt"
        seen = self._bad_values.get(kind, 0)
        self._bad_values[kind] = seen + 1
        if seen:
            logger.debug("npukv_store: remote value %s refused (%s)", name, why)
        elif kind == "mac":
            logger.warning(
                "npukv_store: remote value %s fails its MAC (%s): forged, or put by "
                "a node with another remote_secret_file; recomputing it and any "
                "such value after (remote_load_mac_failed)", name, why,
            )  # fmt: skip
        else:
            logger.warning(
                "npukv_store: remote value %s is not the block asked for (%s); "
                "recomputing it and any such value after (remote_load_corrupt)",
                name, why,
            )  # fmt: skip

    def _values_good(self) -> None:
        """A load whose values all verified: the next bad one warns again."""
        if self._bad_values:
            counts, self._bad_values = self._bad_values, {}
            logger.info(
                "npukv_store: remote values verify again (%d refused since the "
                "warning)", sum(counts.values()),
            )  # fmt: skip


def _lay_out_values(
    staging: np.ndarray,
    layout: ValueLayout,
    fingerprint: bytes,
    keys: Sequence[bytes],
    pieces: Pieces,
    secrets: RemoteKeys,
) -> None:
    """Write the whole value of every key into ``staging`` (value-major):
    its prefix, then its pieces (checksums and rows) copied in one native
    call, GIL released, then the MAC over the prefix and the checksums as
    they landed (the header piece's last part)."""
    size = layout.value_bytes
    values = staging.reshape(len(keys), size)
    prefix_bytes = len(layout.prefix(fingerprint, b"\0" * 16))
    values[:, :prefix_bytes] = np.frombuffer(
        b"".join(layout.prefix(fingerprint, key) for key in keys), np.uint8
    ).reshape(len(keys), prefix_bytes)
    src, dst, sizes = [], [], []
    base = staging.ctypes.data
    for i, key_pieces in enumerate(pieces):
        offset = base + i * size + SUMS_OFFSET
        for address, nbytes in key_pieces:
            src.append(address)
            dst.append(offset)
            sizes.append(nbytes)
            offset += nbytes
        if offset != base + (i + 1) * size:
            raise ValueError(
                f"pieces of key {i}: found {offset - base - i * size - SUMS_OFFSET} "
                f"bytes, expected {size - SUMS_OFFSET}"
            )
    native.copy_ptrs(
        np.array(src, np.int64), np.array(dst, np.int64), np.array(sizes, np.int64)
    )
    layout.sign(secrets.mac_key, values)
