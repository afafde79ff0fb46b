"""Waiting for a lock file of the cache directory, with a bound, and naming
whoever holds it.

Runs in: any process opening a store (``.lock``) and the maintenance job.

    open_lock_file() - a lock file of the root: O_NOFOLLOW, 0600/0660, checked
                      to be ours and a single link before anything is written
    wait_for_lock() - an exclusive flock within a timeout, or one ConfigError
                      naming the holder
    lock_holder()   - the pid(s) /proc/locks names for a file, else what the
                      holder wrote into it

Why a bound: any process that can open the lock file can take the lock and
keep it; without a bound every server start and every ``npukv`` command
would then hang for good (with no line saying why). The lock files are 0600
(0660 in group mode), so only the owner (or the group) can.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time

from npukv_store.errors import ConfigError
from npukv_store.store.dirfd import DirFD, check_entry


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


def wait_for_lock(fd: int, path: str, timeout_s: float) -> None:
    """Take an exclusive flock on ``fd`` within ``timeout_s``.

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
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
