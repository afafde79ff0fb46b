"""The C extension ``npukv_store._native``, or its pure-Python twin.

Runs in: any process. ``NPUKV_NATIVE=0`` selects the twin (the same tests run
against both, as py-lmdb does with ``LMDB_FORCE_CFFI``); so does a missing or
stale build, with one warning.

    sync_file_range_write() - start writeback of a file range, don't wait
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

ABI_VERSION = 2
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
