"""Save claims: which process is writing which block, shared by every process of
a cache directory.

Runs in: every process that saves, and the maintenance job (which sweeps the
claims of dead processes). Thread-safe.

    claim()    - take the keys no live process holds; returns per key if won
    release()  - drop our claims once the chunk is committed or dropped
    held()     - how many claims exist (``npukv stats``; none after a flush)
    sweep()    - delete the claims of dead processes and expired ones

A claim is ``key -> (pid, deadline)``. A claim whose holder is dead, or whose
deadline passed, is taken over: a writer killed mid-save never blocks a block
for good. Two servers that compute the same prefix at once then write it once:
the second finds the first's claims and skips those blocks.

Why a second LMDB environment (``<cache_dir>/claims/``) beside the index: a
claim is a lease, not data, so its transactions are never fsynced (a crash
voids the leases anyway), and they never queue behind an index commit, whose
transaction holds the index's write lock across an fsync. A claim of 256 keys
is one short write transaction of memory writes.

Records are untrusted: in a group-shared directory any member can write
them. Every number read is bounded before it is used: a pid no process can
have (0, 2**31 and up) is a dead holder, a deadline further ahead than a
claim can last (a claim is made for ``CLAIM_TTL_S`` from now) is an expired
claim, and a record of the wrong size is no claim. So no record can block a
block's saves for longer than one lifetime, and sweep removes all of these.
The environment is opened by :func:`.envs.open_env`: with ``meminit`` (no
leftover heap bytes, such as token ids, in the file), the access's modes
(0700/0600 unless group-shared), and ``claims/`` checked to be ours and no
symlink first.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import time
from collections.abc import Sequence

import lmdb

from npukv_store.liveness import pid_alive, safe_pid
from npukv_store.store.envs import open_env, release_env
from npukv_store.store.permissions import Access

logger = logging.getLogger(__name__)

#: How long a claim holds without its holder finishing: far above any save's
#: time in the ring and on disk, so a live writer's claim never expires under it;
#: a holder that is alive but stuck for that long loses its claim, and the block
#: is at worst written twice (a dead row for compaction).
CLAIM_TTL_S = 120.0
_CLAIM_TTL_NS = int(CLAIM_TTL_S * 1e9)
#: How far past ``now + CLAIM_TTL_S`` a deadline may lie and still hold: a
#: reader's ``now`` may be taken just before another process's claim (whose
#: ``now`` is later) commits. A step of the clock back by more only costs a
#: block written twice.
_SKEW_NS = 10 * 10**9
_CLAIM = struct.Struct("<IQ")  # holder pid, deadline ns
_MAP_SIZE = 256 << 20  # 16-byte keys and 12-byte values: millions of claims


class ClaimTable:
    """The claims of one cache directory (``<cache_dir>/claims/``)."""

    def __init__(self, path: str, access: Access | None = None) -> None:
        """Open (creating if needed) the table at ``path``.

        Args:
            access: who may use the directory (default: private, a 0700
                directory and 0600 files).

        Raises:
            UnsafeEntry: ``path`` or its files are symlinks or another user's.
        """
        self.path = path
        self._released = True
        try:
            self._env = open_env(path, _MAP_SIZE, sync=False, access=access)
        except lmdb.Error:
            # Leases only: a garbled table is dropped and started afresh (every
            # claim in it would have been taken over at its deadline anyway).
            logger.warning("claims table %s unreadable; recreating", path)
            shutil.rmtree(path, ignore_errors=True)
            self._env = open_env(path, _MAP_SIZE, sync=False, access=access)
        self._released = False

    def close(self) -> None:
        if not self._released:
            self._released = True
            release_env(self.path)

    def claim(self, keys: Sequence[bytes], *, now_ns: int | None = None) -> list[bool]:
        """Claim ``keys`` for this process; per key, whether it was won.

        A key held by a live process (this one included: a key twice in
        ``keys`` is won once) before its deadline is not won.
        """
        if not keys:
            return []
        now = time.time_ns() if now_ns is None else now_ns
        mine = _CLAIM.pack(os.getpid(), now + _CLAIM_TTL_NS)
        won = []
        with self._env.begin(write=True) as txn:
            for key in keys:
                raw = txn.get(key)
                if raw is not None and _holds(raw, now):
                    won.append(False)
                    continue
                txn.put(key, mine)
                won.append(True)
        return won

    def release(self, keys: Sequence[bytes]) -> None:
        """Drop this process's claims on ``keys`` (others' stay)."""
        if not keys:
            return
        pid = os.getpid()
        with self._env.begin(write=True) as txn:
            for key in keys:
                raw = txn.get(key)
                if raw is not None and _holder(raw) == pid:
                    txn.delete(key)

    def held(self) -> int:
        """Claims in the table, live or not yet swept."""
        with self._env.begin() as txn:
            return int(txn.stat()["entries"])

    def sweep(self, *, now_ns: int | None = None) -> int:
        """Delete the claims of dead processes and expired ones; returns how many."""
        now = time.time_ns() if now_ns is None else now_ns
        with self._env.begin() as txn:
            stale = [bytes(k) for k, v in txn.cursor() if not _holds(v, now)]
        if not stale:
            return 0
        removed = 0
        with self._env.begin(write=True) as txn:
            for key in stale:  # looked at again: it may have been claimed since
                raw = txn.get(key)
                if raw is not None and not _holds(raw, now):
                    removed += txn.delete(key)
        return removed


def _holder(raw: bytes | memoryview) -> int | None:
    """The pid a record names, or None when it names no possible process."""
    if len(raw) != _CLAIM.size:
        return None
    return safe_pid(_CLAIM.unpack(raw)[0])


def _holds(raw: bytes | memoryview, now_ns: int) -> bool:
    """Whether the record ``raw`` still holds its key at ``now_ns``: a live
    holder and a deadline in ``(now, now + CLAIM_TTL_S]`` (plus a few seconds
    of skew between processes). A later deadline was never written by
    :meth:`ClaimTable.claim` (a forged or garbled record, or the clock stepped
    back): expired, so it blocks no save for longer than one claim's lifetime."""
    pid = _holder(raw)
    if pid is None:
        return False
    deadline = _CLAIM.unpack(raw)[1]
    return now_ns < deadline <= now_ns + _CLAIM_TTL_NS + _SKEW_NS and pid_alive(pid)
