"""The C extension ``npukv_store._native``, or its pure-Python twin.

Runs in: any process. ``NPUKV_NATIVE=0`` selects the twin (the same tests run
against both, as py-lmdb does with ``LMDB_FORCE_CFFI``); so does a missing or
stale build, with one warning.

    sync_file_range_write() - start writeback of a file range, don't wait
    xxh3_rows()             - xxh3_64 of each row over several parts (block
                              checksums), without the GIL when native
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

#: anything with the buffer protocol (collections.abc.Buffer needs Python 3.12)
BufferLike = Any

ABI_VERSION = 3
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


def _load() -> ModuleType | None:
    if os.environ.get("NPUKV_NATIVE", "1") == "0":
        return None
    try:
        from npukv_store import _native
    except ImportError:
        logger.warning("npukv_store._native is not built; using the Python twin")
        return None
    if _native.ABI_VERSION != ABI_VERSION:
        logger.warning(
            "npukv_store._native has ABI %d, expected %d (stale build); using the "
            "Python twin",
            _native.ABI_VERSION,
            ABI_VERSION,
        )
        return None
    return _native


IMPL = _load()
IS_NATIVE = IMPL is not None


class _Twin:
    """Pure-Python twins of the native entry points."""

    def __init__(self) -> None:
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name, use_errno=True) if libc_name else None
        self._sync_file_range = getattr(libc, "sync_file_range", None)
        if self._sync_file_range is not None:
            self._sync_file_range.argtypes = [
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_uint,
            ]

    def sync_file_range(self, fd: int, offset: int, nbytes: int, flags: int) -> None:
        if offset < 0 or nbytes < 0:
            raise ValueError("sync_file_range: offset and nbytes must be >= 0")
        if self._sync_file_range is None:
            return  # not Linux: writeback simply starts at fsync
        if self._sync_file_range(fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range: {os.strerror(err)}")


_TWIN = _Twin()


def sync_file_range_write(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset+nbytes)`` back to disk.

    Returns at once; durability still needs ``fsync``. Raises OSError.
    """
    if IMPL is not None:
        IMPL.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
    else:
        _TWIN.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def xxh3_rows(parts: Sequence[BufferLike], num_rows: int) -> np.ndarray:
    """``uint64 [num_rows]``: xxh3_64 of row r of every part, concatenated.

    Each part is a C-contiguous buffer of ``num_rows`` equal rows. Native: one
    call, GIL released (I/O threads run meanwhile). Twin: python-xxhash.
    """
    if IMPL is not None and hasattr(IMPL, "xxh3_rows"):
        return np.frombuffer(IMPL.xxh3_rows(parts, num_rows), dtype="<u8")
    if not parts or num_rows < 1:
        raise ValueError(
            f"xxh3_rows: found {len(parts)} parts and {num_rows} rows, expected "
            "1..64 parts and >= 1 row"
        )
    views = [memoryview(part).cast("B") for part in parts]
    for index, view in enumerate(views):
        if len(view) % num_rows:
            raise ValueError(
                f"xxh3_rows: part {index} has {len(view)} bytes, expected a "
                f"multiple of {num_rows} rows"
            )
    sizes = [len(view) // num_rows for view in views]
    sums = np.empty(num_rows, dtype="<u8")
    for row in range(num_rows):
        digest = xxhash.xxh3_64()
        for view, size in zip(views, sizes, strict=True):
            digest.update(view[row * size : (row + 1) * size])
        sums[row] = digest.intdigest()
    return sums
