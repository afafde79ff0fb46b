"""The staging ring: a /dev/shm file, mapped, carved into FIFO regions.

Runs in: one worker process; producer (the forward pass's save hook) and consumer
(the background writer) are threads of it. Thread-safe: one lock guards the
allocator; it is held for microseconds, never across a copy or any I/O.

    reserve() - a contiguous region for one save batch, or None when full (the
                caller drops the batch and counts it: the producer never waits)
    release() - the writer is done with a region; space comes back in FIFO order
    remove_stale_rings() - unlink rings whose owner process is dead
    scan_rings()         - the stale rings, and how many ring-named files
                           were skipped as not ours (``RingScan``)

A batch's region is laid out exactly like the chunk file it becomes (header page,
then the data section layer by layer, then the checksum table), so the writer
writes it to disk with a few large writes and no copy. Regions start on
4096-byte boundaries (page and O_DIRECT alignment).

Shared header (the first 4096 bytes of the file, little-endian)::

    0  magic  8s  b"NPUKVRNG"   written once by the owner at creation
    8  format u32 RING_FORMAT   written once; readers refuse another value
    12 header u32 4096          written once
    16 size   u64 data bytes    written once
    24 pid    u32 owner pid     written once; stale-ring cleanup reads it
    32 head   u64 next reserve  owner only, after each reserve; informational
    40 tail   u64 oldest live   owner only, after each release; informational

Only the owner writes; other processes only read magic/format/pid to find
stale rings, so there is no cross-process ordering to get wrong. A stale read
of head/tail (they are for ``npukv`` inspection) costs nothing. A killed owner
leaves the file; the next ring created in that directory removes it.

/dev/shm is shared by every local user, so whatever is named like a ring there
is untrusted: a FIFO (a plain open of it blocks), a symlink, a directory,
another user's ring (unlinking it fails with EPERM in the sticky /dev/shm), a
pid of 2**32 - 1 in a header (``os.kill`` overflows). The scan opens only
regular files we own, without blocking or following links, and skips and counts
the rest; it never raises, so nothing planted there can stall or turn off a
worker's ring creation or gc (docs/security.md).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import shutil
import stat
import struct
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from npukv_store.errors import BadMagic, ConfigError, VersionMismatch
from npukv_store.liveness import pid_alive

logger = logging.getLogger(__name__)

RING_MAGIC = b"NPUKVRNG"
RING_FORMAT = 1
HEADER_BYTES = 4096
ALIGN = 4096
_HEADER = struct.Struct("<8sIIQI")  # magic, format, header bytes, size, pid
_HEAD_TAIL = struct.Struct("<QQ")
_HEAD_TAIL_OFFSET = 32
NAME_PREFIX = "npukv-ring-"
#: How the stale-ring scan opens a file named like a ring: never blocking (a
#: FIFO), never following a symlink, never leaking the fd into a child.
_SCAN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
#: Fresh names tried when creating a ring before giving up: a name is only
#: taken by a leftover of a dead process with our pid and the same 32 random
#: bits, or by a file someone planted, so the second try all but always works.
_CREATE_TRIES = 16
#: What one file of a scan may raise: an fs error (ELOOP for a symlink, EACCES,
#: ENXIO for a socket, vanished), not a ring, and values no pid can have.
_SKIP_ERRORS = (OSError, OverflowError, ValueError, BadMagic, VersionMismatch)

_skipped_lock = threading.Lock()
#: Ring-named files skipped by every scan of this process so far (not regular,
#: another user's, unreadable, not a ring, or not removable): for stats.
skipped_foreign = 0


class RingNoRoom(ConfigError):
    """The ring directory cannot hold a ring of the size asked for; ``reason``
    says what creating it met (the error, the bytes free)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Region:
    """A reserved range of the ring's data area: ``[offset, offset + nbytes)``."""

    offset: int
    nbytes: int
    seq: int
    released: bool = False


class StagingRing:
    """A FIFO allocator of contiguous regions over a mapped /dev/shm file.

    Args:
        size_bytes: bytes of the data area (rounded up to 4096).
        directory: where the ring file lives (``/dev/shm``: page cache only).
    """

    def __init__(self, size_bytes: int, *, directory: str = "/dev/shm") -> None:
        if size_bytes < ALIGN:
            raise ValueError(f"ring size: found {size_bytes}, expected >= {ALIGN}")
        self.size = -(-size_bytes // ALIGN) * ALIGN
        scan = scan_rings(directory)
        self.stale_removed = _remove(scan.stale)
        self.skipped_foreign = scan.skipped_foreign
        self.path, fd = _create(directory)
        try:
            # Reserve the pages now: on tmpfs a ring larger than the free space
            # would otherwise SIGBUS on first touch, killing the process.
            os.posix_fallocate(fd, 0, HEADER_BYTES + self.size)
            self._map = mmap.mmap(fd, HEADER_BYTES + self.size)
        except OSError as exc:
            os.close(fd)
            os.unlink(self.path)
            free = shutil.disk_usage(directory).free
            reason = f"{exc.strerror}; {free} bytes free"
            raise RingNoRoom(
                f"ring_size: found {self.size} bytes, but {directory} cannot hold "
                f"them ({reason}); expected a smaller ring_size or a larger "
                "/dev/shm (docker/podman --shm-size)",
                reason,
            ) from exc
        os.close(fd)
        _HEADER.pack_into(
            self._map, 0, RING_MAGIC, RING_FORMAT, HEADER_BYTES, self.size, os.getpid()
        )
        self.data = np.frombuffer(self._map, dtype=np.uint8, offset=HEADER_BYTES)
        self.data[::ALIGN] = 0  # pre-fault every page now, not on the hot path
        self._lock = threading.Lock()
        self._live: deque[Region] = deque()  # reserved, in FIFO order
        self._head = 0  # next reserve starts here (or wraps to 0)
        self._seq = 0
        self.reserved_count = 0
        self.full_count = 0

    def reserve(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes`` (rounded up to 4096), or None if the
        ring has no contiguous room now. Never blocks."""
        if nbytes <= 0:
            raise ValueError(f"reserve: found {nbytes} bytes, expected > 0")
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            offset = self._find_room(size)
            if offset is None:
                self.full_count += 1
                return None
            region = Region(offset, size, self._seq)
            self._seq += 1
            self._live.append(region)
            self._head = offset + size
            self.reserved_count += 1
            self._publish_head_tail()
            return region

    def _find_room(self, size: int) -> int | None:
        if not self._live:
            self._head = 0  # empty: start over at the bottom, no wasted tail
            return 0 if size <= self.size else None
        tail = self._live[0].offset
        if self._head > tail:  # live data in [tail, head): free above and below
            if self._head + size <= self.size:
                return self._head
            return 0 if size <= tail else None  # wrap, leaving [head, size) idle
        # wrapped: live data in [tail, size) and [0, head); free is [head, tail)
        return self._head if self._head + size <= tail else None

    def release(self, region: Region) -> None:
        """Give ``region`` back. Space returns in FIFO order: a region released
        before an older one is reclaimed when the older one is released too."""
        with self._lock:
            if region.released:
                raise ValueError(f"region {region.seq} released twice")
            region.released = True
            while self._live and self._live[0].released:
                self._live.popleft()
            self._publish_head_tail()

    def view(self, region: Region) -> np.ndarray:
        """The region's bytes (uint8), valid until it is released."""
        return self.data[region.offset : region.offset + region.nbytes]

    @property
    def used_bytes(self) -> int:
        """Bytes of the regions reserved and not yet reclaimed."""
        with self._lock:
            return sum(region.nbytes for region in self._live)

    @property
    def live_regions(self) -> int:
        """Regions reserved and not yet reclaimed."""
        with self._lock:
            return len(self._live)

    def _publish_head_tail(self) -> None:
        tail = self._live[0].offset if self._live else self._head
        _HEAD_TAIL.pack_into(self._map, _HEAD_TAIL_OFFSET, self._head, tail)

    def close(self) -> None:
        """Unmap and unlink the ring. Idempotent; regions become invalid."""
        if getattr(self, "_map", None) is None:
            return
        del self.data
        with contextlib.suppress(BufferError):  # a caller still holds a view
            self._map.close()
        self._map = None  # type: ignore[assignment]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def read_ring_header(path: str, *, owned: bool = False) -> tuple[int, int]:
    """``(size, owner pid)`` of the ring file at ``path``.

    Never blocks and never follows a symlink: ``path`` is opened with
    O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC (a plain open of a FIFO named like a
    ring blocks until a writer comes; a symlink could point anywhere), then
    fstat'ed, and only a regular file (owned by this user, with ``owned``) is
    read.

    Raises:
        BadMagic: not a ring file (not a regular file, another user's with
        ``owned``, or no ring magic). VersionMismatch: another ring format.
        OSError: cannot be opened (a symlink: ELOOP).
    """
    fd = os.open(path, _SCAN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadMagic(f"{path}: not a regular file; not an npukv ring")
        if owned and info.st_uid != os.geteuid():
            raise BadMagic(f"{path}: owned by uid {info.st_uid}; not our ring")
        raw = os.pread(fd, _HEADER.size, 0)
    finally:
        os.close(fd)
    if len(raw) < _HEADER.size or raw[:8] != RING_MAGIC:
        raise BadMagic(f"{path}: no ring magic {RING_MAGIC!r}; not an npukv ring")
    _, fmt, _, size, pid = _HEADER.unpack(raw)
    if fmt != RING_FORMAT:
        raise VersionMismatch(f"{path}: ring format {fmt}, expected {RING_FORMAT}")
    return size, pid


@dataclass(frozen=True, slots=True)
class RingScan:
    """One scan of a ring directory: the stale rings found (ours, owner dead)
    and how many ring-named files were skipped as not ours to judge."""

    stale: list[str]
    skipped_foreign: int


def _count_skipped(count: int) -> None:
    global skipped_foreign
    if count:
        with _skipped_lock:
            skipped_foreign += count


def scan_rings(directory: str = "/dev/shm") -> RingScan:
    """The rings in ``directory`` whose owner process is dead. Never raises,
    never blocks.

    Only regular files owned by this user count: anything else named like a
    ring (a FIFO, a symlink, a directory, another user's file, one we cannot
    read, a header that is not a ring's) is skipped, counted and left as it is
    (see :func:`read_ring_header`). A header pid no process can have (0,
    2**32 - 1) is a dead owner.
    """
    try:
        names = [n for n in os.listdir(directory) if n.startswith(NAME_PREFIX)]
    except OSError:
        return RingScan([], 0)  # no such directory, or not ours to list
    stale, skipped = [], 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            _, pid = read_ring_header(path, owned=True)
            alive = pid_alive(pid)
        except FileNotFoundError:
            continue  # gone already: its owner closed it or another cleaner won
        except _SKIP_ERRORS:
            skipped += 1  # not ours to judge
            continue
        if not alive:
            stale.append(path)
    _count_skipped(skipped)
    return RingScan(stale, skipped)


def stale_rings(directory: str = "/dev/shm") -> list[str]:
    """The paths of :func:`scan_rings`' stale rings."""
    return scan_rings(directory).stale


def remove_stale_rings(directory: str = "/dev/shm") -> int:
    """Unlink rings in ``directory`` whose owner is dead; returns how many.
    Never raises: one that cannot be removed is skipped and counted."""
    return _remove(scan_rings(directory).stale)


def _remove(paths: list[str]) -> int:
    removed = skipped = 0
    for path in paths:
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                skipped += 1  # replaced since the scan: not ours any more
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue  # another cleaner won
        except OSError:
            skipped += 1  # EPERM/EROFS: left for its owner or the operator
            continue
        removed += 1
        logger.info("removed stale staging ring %s of a dead owner", path)
    _count_skipped(skipped)
    return removed


def _create(directory: str) -> tuple[str, int]:
    """A new ring file's path and an fd open on it, under a fresh random name.

    A name already taken (a planted file, a FIFO, a symlink or another user's
    ring: O_EXCL refuses all of them, never opening or following them) is
    retried under another name rather than failing the worker.

    Raises:
        ConfigError: every one of the fresh names was taken.
        OSError: ``directory`` refused the create (not writable, gone).
    """
    last: OSError | None = None
    for _ in range(_CREATE_TRIES):
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(directory, name)
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return path, os.open(path, flags, 0o600)
        except FileExistsError as exc:
            last = exc
            _count_skipped(1)
    raise ConfigError(
        f"ring directory {directory}: found every one of {_CREATE_TRIES} fresh "
        f"ring names taken ({last}); expected a directory where this user can "
        "create files"
    )
