"""O_DIRECT file access (``StoreConfig.direct_io``): aligned buffers, opening
with a buffered fallback, and reads of any byte range.

Runs in: any process; thread-safe (the set of warned filesystems has a lock).

    DIRECT_ALIGN_BYTES - what buffer addresses, offsets and lengths are multiples of
    align_up()         - round a byte count up to DIRECT_ALIGN_BYTES
    aligned_buffer()   - a zeroed uint8 array at an aligned address
    open_direct()      - os.open + O_DIRECT, or buffered (one warning per
                         filesystem) where the filesystem refuses it
    read_unaligned()   - any byte range through an aligned superset read into a
                         bounce buffer

The engines do not fix alignment: an unaligned request on an O_DIRECT fd comes
back as -EINVAL from either. Writes must be whole aligned blocks, so a file whose
size is not a multiple of DIRECT_ALIGN_BYTES is written padded and then truncated.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading

import numpy as np

from npukv_store.io.engine import READ, IOEngine, IORequest

logger = logging.getLogger(__name__)

#: O_DIRECT needs multiples of the device's logical block size (512 or 4096).
#: 4096 satisfies both; Python's os cannot ask (statx STATX_DIOALIGN).
DIRECT_ALIGN_BYTES = 4096

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # absent on macOS: always buffered
_warned_devices: set[int] = set()
_warned_lock = threading.Lock()


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of DIRECT_ALIGN_BYTES."""
    return -(-nbytes // DIRECT_ALIGN_BYTES) * DIRECT_ALIGN_BYTES


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A zeroed ``uint8 [nbytes]`` array whose address is a multiple of
    DIRECT_ALIGN_BYTES (a view into a slightly larger allocation, which it
    keeps alive). Its length is ``nbytes`` as given, aligned or not."""
    raw = np.zeros(nbytes + DIRECT_ALIGN_BYTES, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN_BYTES
    return raw[skip : skip + nbytes]


def open_direct(
    path: str | os.PathLike[str], flags: int, mode: int = 0o644
) -> tuple[int, bool]:
    """Open ``path`` with O_DIRECT added to ``flags``.

    The file is opened without O_DIRECT first and O_DIRECT set with fcntl, not
    passed to open(): on a filesystem that refuses it, open(O_CREAT | O_DIRECT)
    creates the file and then fails, and the retry would break O_EXCL.

    Returns:
        ``(fd, direct)``: ``direct`` is False where the filesystem refused
        O_DIRECT (EINVAL: procfs, tmpfs before Linux 6.6, some FUSE); the fd
        is then buffered, and one warning is logged per filesystem.

    Raises:
        OSError: from open(), or from fcntl with another errno than EINVAL.
    """
    fd = os.open(path, flags, mode)
    try:
        if _O_DIRECT:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
            return fd, True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            os.close(fd)
            raise
    device = os.fstat(fd).st_dev
    with _warned_lock:
        first = device not in _warned_devices
        _warned_devices.add(device)
    if first:
        logger.warning(
            "direct_io: the filesystem of %s refuses O_DIRECT; using buffered I/O "
            "there",
            os.fsdecode(path),
        )
    return fd, False


def read_unaligned(engine: IOEngine, fd: int, offset: int, dest: memoryview) -> int:
    """Read ``len(dest)`` bytes at ``offset`` of an O_DIRECT ``fd`` into ``dest``.

    Reads the enclosing aligned range into a bounce buffer, then copies the
    wanted bytes: one extra copy, in exchange for no alignment rule on the
    caller. ``engine`` must have nothing else in flight (its completions would
    be consumed here).

    Returns:
        Bytes copied (fewer at EOF, 0 past it), or -errno.

    Raises:
        ValueError: a negative offset, or requests already in flight.
    """
    if offset < 0 or engine.in_flight:
        raise ValueError(
            f"read_unaligned: found offset {offset} and {engine.in_flight} requests "
            "in flight, expected offset >= 0 and an idle engine"
        )
    out = memoryview(dest).cast("B")
    start = offset - offset % DIRECT_ALIGN_BYTES
    skip = offset - start
    bounce = aligned_buffer(align_up(offset + len(out)) - start)
    (done,) = engine.run([IORequest(READ, fd, start, bounce.data, 0)])
    if done.result < 0:
        return done.result
    got = max(0, min(done.result - skip, len(out)))
    out[:got] = bounce.data[skip : skip + got]
    return got
