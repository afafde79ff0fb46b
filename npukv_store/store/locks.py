"""Waiting for a lock file of the cache directory, with a bound, and naming
whoever holds it.

Runs in: any process opening a store (``.lock``) and the maintenance job.

    open_lock_file() - a lock file of the root: O_NOFOLLOW, 0600/0660, checked
                      to be ours and a single link before anything is written
    wait_for_lock() - an exclusive flock within a timeout, or one ConfigError
                      naming the holder
    lock_holder()   - the pid(s) /proc/locks names for a file, else what the
                      holder wrote into it
    shared_lock()   - the directory lock (``.lock``) taken shared: opens of an
                      index that needs no rebuild run side by side
    lock_byte() / byte_locked() / unlock_byte() - one byte of ``.lock`` held
                      as a process's sign of life (a session,
                      :mod:`.sessions`; a rebuild): the kernel drops it when
                      the process dies, whatever its pid becomes

Why byte locks for liveness, not pids: a pid is reused, differs in another
pid namespace, and says nothing after a reboot; an open-file-description
(OFD) lock is held exactly as long as the process (or a fork of it that kept
the descriptor) lives. flock() on ``.lock`` and these fcntl() byte locks do
not interact on a local Linux file system (on NFS flock is emulated with
byte locks; LMDB does not work there either).

Why a bound: any process that can open the lock file can take the lock and
keep it; without a bound every server start and every ``npukv`` command
would then hang for good (with no line saying why). The lock files are 0600
(0660 in group mode), so only the owner (or the group) can.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator

from npukv_store.errors import ConfigError
from npukv_store.store.dirfd import DirFD, check_entry

logger = logging.getLogger(__name__)


def open_lock_file(cache: DirFD, name: str) -> int:
    """A lock file of the root, opened read-write (created with the
    access's mode: 0600 keeps others from taking the lock), checked to be
    a regular file of ours with no other link before anything is written.

    Raises:
        UnsafeEntry: naming what is there instead.
    """
    fd = cache.open_file(name, os.O_RDWR | os.O_CREAT)
    try:
        st = os.fstat(fd)
        check_entry(
            cache.full(name), st, cache.access, directory=False, single_link=True
        )
        mode = cache.access.file_mode
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)  # made by an older version: 0644
    except BaseException:
        os.close(fd)
        raise
    return fd


#: Offsets of the bytes of ``.lock`` that processes hold as signs of life,
#: far past the pid@host text :meth:`CacheDir.locked` writes at offset 0.
REBUILD_BYTES = 1 << 40  # a rebuild's: REBUILD_BYTES + n, n < MAX_SLOTS
SESSION_BYTES = REBUILD_BYTES + (1 << 20)  # a session's: SESSION_BYTES + slot
MAX_SLOTS = 1 << 20
#: held by the opener that records a new boot (:func:`.sessions.begin_session`)
BOOT_BYTE = SESSION_BYTES + MAX_SLOTS


class _Flock(ctypes.Structure):
    """``struct flock`` as the C library lays it out (padding included)."""

    _fields_ = [
        ("l_type", ctypes.c_short),
        ("l_whence", ctypes.c_short),
        ("l_start", ctypes.c_int64),
        ("l_len", ctypes.c_int64),
        ("l_pid", ctypes.c_int),
    ]


def _byte_fcntl(fd: int, command: int, kind: int, offset: int) -> _Flock:
    request = _Flock(kind, os.SEEK_SET, offset, 1, 0)  # OFD locks need pid 0
    return _Flock.from_buffer_copy(fcntl.fcntl(fd, command, bytes(request)))


def lock_byte(fd: int, offset: int) -> bool:
    """Hold byte ``offset`` of ``fd``'s file for this open file description;
    False (at once) if another description holds it."""
    try:
        _byte_fcntl(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK, offset)
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held
        return False
    return True


def unlock_byte(fd: int, offset: int) -> None:
    """Release byte ``offset`` held through ``fd``'s description."""
    _byte_fcntl(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, offset)


def byte_locked(fd: int, offset: int) -> bool:
    """Whether a description other than ``fd``'s holds byte ``offset``: its
    holder is alive (a description ``fd`` shares is never "other")."""
    found = _byte_fcntl(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, offset)
    return bool(found.l_type != fcntl.F_UNLCK)


@contextlib.contextmanager
def shared_lock(cache: DirFD, timeout_s: float) -> Iterator[int]:
    """Hold ``.lock`` shared (yields its descriptor): many opening processes
    at once, none while a process holds it exclusive (``CacheDir.locked``,
    to swap a rebuilt index in).

    Raises:
        ConfigError: held exclusive for ``timeout_s``, naming the holder.
        UnsafeEntry: ``.lock`` is a symlink or not ours.
    """
    fd = open_lock_file(cache, ".lock")
    try:
        wait_for_lock(fd, cache.full(".lock"), timeout_s, shared=True)
        yield fd
    finally:
        os.close(fd)


def wait_for_lock(
    fd: int, path: str, timeout_s: float, *, shared: bool = False
) -> None:
    """Take an exclusive (or ``shared``) flock on ``fd`` within ``timeout_s``.

    Polled with LOCK_NB rather than a blocking flock interrupted by SIGALRM:
    a signal handler is process-wide and only the main thread may set one,
    and a store is opened from any thread. The poll starts at 1 ms and backs
    off to 50 ms, so an uncontended open pays nothing and a contended one
    waits at most 50 ms past the release.

    Raises:
        ConfigError: still held after ``timeout_s``, naming the holder.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(
                fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
            )
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"{path}: held by {lock_holder(fd)} for over {timeout_s:g} s "
                    "(lock_timeout_s); expected it to be released: a process "
                    "stuck in recovery, or another user holding it"
                ) from None
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.05)


def lock_holder(fd: int) -> str:
    """Who holds the flock on ``fd``'s file: the pids /proc/locks names for
    its inode (the kernel's word, whoever took it), else the pid@host the
    holder wrote into the file, else "another process"."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line
    # carries a "->" after the number, so its fields do not match
    with (
        contextlib.suppress(OSError),
        open("/proc/locks", encoding="ascii", errors="replace") as handle,
    ):
        for line in handle:
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == dev:
                pids.append(fields[4])
    if pids:
        return "pid " + ", ".join(sorted(set(pids), key=int))
    written = os.pread(fd, 64, 0).decode(errors="replace").strip()
    return f"pid@host {written!r}" if written else "another process"
