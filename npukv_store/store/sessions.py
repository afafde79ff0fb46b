"""Which store handles have a cache directory open, and which died with it
open: what decides whether an open scans for garbage (docs/decisions/0059).

Runs in: every process opening a store (``begin_session``), and the
maintenance job (``dead_sessions`` / ``forget_sessions``, after its scan).

    begin_session()   - take a slot: hold its byte of ``.lock``, write its
                        record into ``sessions``; report the dead ones found,
                        and whether the machine restarted since the last open
    Session.end()     - a clean close: the record is cleared, then the byte
    dead_sessions()   - records whose byte nobody holds (their process died)
    forget_sessions() - clear those records, each only while still dead

``sessions`` holds one ``SLOT_BYTES`` record per slot: ``S`` and
``pid@host opened-ns``, or zeros when free. A slot's process holds byte
``SESSION_BYTES + slot`` of ``.lock`` with an OFD lock while its handle is
open; the kernel drops it when the process dies. A record whose byte is free
is a process that died with the store open: it may have left garbage.

Why a plain file, not the index's meta db (the first form of 0059): a record
in LMDB is a write transaction, and LMDB serialises those across processes,
each ending in a disk flush. The 17 processes of a TP 16 engine opening at
once then queued behind 17-34 flushes (measured: the last waited 186 ms where
its open took 2 ms of CPU). A ``pwrite`` of one record into a slot no other
process writes (its byte lock says whose it is) needs no lock and no flush.
Unsynced, a record may be lost in a power cut. So ``boot`` holds the boot
id of the machine that last opened the directory (Linux's
``/proc/sys/kernel/random/boot_id``, new at every boot): the first open of a
boot finds another id there, records its own and scans, whatever ``sessions``
kept (docs/decisions/0072). A kill -9 keeps the page cache, so within one
boot the records are enough; a power cut ends the boot. ``boot`` needs no
sync either: lost, it holds an older id, and the next open scans again.
Garbage is never visible to readers; it only holds disk space.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time

from npukv_store.store.dirfd import DirFD
from npukv_store.store.locks import (
    BOOT_BYTE,
    SESSION_BYTES,
    byte_locked,
    lock_byte,
    open_lock_file,
    unlock_byte,
)

logger = logging.getLogger(__name__)

SESSIONS_FILE = "sessions"
BOOT_FILE = "boot"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_BOOT_BYTES = 64  # a boot id is 36 bytes of text
SLOT_BYTES = 128
#: Handles open at once on one directory, at most: bounds what an open reads
#: (8 MiB of records, should the file ever be garbage of that size).
MAX_SLOTS = 1 << 16
_OPEN = b"S"  # the first byte of a written record
_FREE = bytes(SLOT_BYTES)


class Session:
    """A handle's sign of life: record ``slot`` of ``sessions``, and byte
    ``SESSION_BYTES + slot`` of ``.lock`` held through ``lock_fd``.

    Attributes:
        dead: the records of dead sessions this one found, by slot (and
            cleared, after registering itself: if this process dies before
            it has scanned, its own record says so to the next).
        new_boot: this open is the first since the machine restarted (it
            recorded the boot): every session of the last boot died, whether
            or not its record outlived the power cut.
    """

    def __init__(self, lock_fd: int, records_fd: int, slot: int) -> None:
        self.lock_fd, self.records_fd, self.slot = lock_fd, records_fd, slot
        self.dead: dict[int, bytes] = {}
        self.new_boot = False

    @property
    def must_scan(self) -> bool:
        """Whether the open must look for garbage (a dead session's, or the
        last boot's)."""
        return bool(self.dead) or self.new_boot

    def end(self) -> None:
        """A clean close: the record goes first, then the byte."""
        try:
            os.pwrite(self.records_fd, _FREE, self.slot * SLOT_BYTES)
        finally:
            self.drop_after_fork()

    def drop_after_fork(self) -> None:
        """Close the descriptors only (in a fork's child: unlocking through
        the inherited one would release the parent's byte; they share it)."""
        try:
            os.close(self.records_fd)
        finally:
            os.close(self.lock_fd)


def begin_session(cdir: DirFD) -> Session:
    """Register a handle as open: a byte lock and a record ``pwrite``, no
    lock shared with other openers and no disk flush (the same cost at 10^3
    chunks as at 10^7, and for the 17th process as for the first).

    Raises:
        UnsafeEntry: ``.lock`` or ``sessions`` is a symlink or not ours.
        OSError: every slot is taken.
    """
    lock_fd = open_lock_file(cdir, ".lock")
    try:
        records_fd = open_lock_file(cdir, SESSIONS_FILE)
    except BaseException:
        os.close(lock_fd)
        raise
    try:
        records = _read_records(records_fd)
        dead = {s: v for s, v in records.items() if not _alive(lock_fd, s)}
        value = f"{os.getpid()}@{socket.gethostname()} {time.time_ns()}".encode()
        record = (_OPEN + value)[:SLOT_BYTES].ljust(SLOT_BYTES, b"\0")
        for slot in range(MAX_SLOTS):
            if slot in records or not lock_byte(lock_fd, SESSION_BYTES + slot):
                continue
            found = _read_slot(records_fd, slot)
            if found is not None:
                # Written since we read the file, and its byte was free: a
                # session that died meanwhile. Ours to scan for.
                dead[slot] = found
                continue
            os.pwrite(records_fd, record, slot * SLOT_BYTES)
            break
        else:
            raise OSError(f"{cdir.full(SESSIONS_FILE)}: no free session slot")
        session = Session(lock_fd, records_fd, slot)
    except BaseException:
        os.close(records_fd)
        os.close(lock_fd)
        raise
    if dead:
        logger.info("%d process(es) left %s without closing", len(dead), cdir.root)
        _forget(lock_fd, records_fd, dead)
    session.dead = dead
    try:
        session.new_boot = _record_boot(cdir, lock_fd)
    except BaseException:
        session.end()
        raise
    return session


@functools.cache  # constant for the process's life: read once, not per open
def boot_id() -> bytes | None:
    """This boot's id (None where the kernel gives none: no boot check)."""
    try:
        with open(BOOT_ID_PATH, "rb") as f:
            return f.read(_BOOT_BYTES).strip() or None
    except OSError:
        return None


def _record_boot(cdir: DirFD, lock_fd: int) -> bool:
    """Record this boot in ``boot``; True for the one opener that found
    another boot there (it scans). One read in the common case."""
    current = boot_id()
    if current is None:
        return False
    fd = open_lock_file(cdir, BOOT_FILE)
    try:
        if os.pread(fd, _BOOT_BYTES, 0).rstrip(b"\0") == current:
            return False
        # Openers racing after a reboot: one takes the byte and scans; the
        # others find it taken and leave the scan to it.
        if not lock_byte(lock_fd, BOOT_BYTE):
            return False
        try:
            if os.pread(fd, _BOOT_BYTES, 0).rstrip(b"\0") == current:
                return False
            os.pwrite(fd, current.ljust(_BOOT_BYTES, b"\0"), 0)
            return True
        finally:
            unlock_byte(lock_fd, BOOT_BYTE)
    finally:
        os.close(fd)


def dead_sessions(cdir: DirFD) -> dict[int, bytes]:
    """The records, by slot, whose process is gone (the maintenance job
    forgets them after its scan)."""
    lock_fd = open_lock_file(cdir, ".lock")
    try:
        records_fd = open_lock_file(cdir, SESSIONS_FILE)
        try:
            records = _read_records(records_fd)
        finally:
            os.close(records_fd)
        return {s: v for s, v in records.items() if not _alive(lock_fd, s)}
    finally:
        os.close(lock_fd)


def forget_sessions(cdir: DirFD, dead: dict[int, bytes]) -> None:
    """Clear each of ``dead``'s records that is still there and still dead."""
    if not dead:
        return
    lock_fd = open_lock_file(cdir, ".lock")
    try:
        records_fd = open_lock_file(cdir, SESSIONS_FILE)
        try:
            _forget(lock_fd, records_fd, dead)
        finally:
            os.close(records_fd)
    finally:
        os.close(lock_fd)


def _forget(lock_fd: int, records_fd: int, dead: dict[int, bytes]) -> None:
    for slot, value in dead.items():
        # Held for the compare and the clear: a process taking the slot
        # meanwhile would hold it first (never one of ours: ours is alive).
        if not lock_byte(lock_fd, SESSION_BYTES + slot):
            continue
        try:
            if _read_slot(records_fd, slot) == value:
                os.pwrite(records_fd, _FREE, slot * SLOT_BYTES)
        finally:
            unlock_byte(lock_fd, SESSION_BYTES + slot)


def _alive(lock_fd: int, slot: int) -> bool:
    return slot < MAX_SLOTS and byte_locked(lock_fd, SESSION_BYTES + slot)


def _parse(raw: bytes) -> bytes | None:
    """A slot's record, or None where it is free. Bytes not of the shape
    we write are a record too (of no live process: forgotten as dead)."""
    if raw[:1] == _OPEN:
        return raw[1:].rstrip(b"\0")
    return raw.rstrip(b"\0") or None


def _read_slot(records_fd: int, slot: int) -> bytes | None:
    return _parse(os.pread(records_fd, SLOT_BYTES, slot * SLOT_BYTES))


def _read_records(records_fd: int) -> dict[int, bytes]:
    """Every slot's record: one read of the file (a slot is taken lowest
    free first, so the file is as long as the most sessions ever open at once)."""
    size = min(os.fstat(records_fd).st_size, MAX_SLOTS * SLOT_BYTES)
    raw = os.pread(records_fd, size, 0)
    records: dict[int, bytes] = {}
    for at in range(0, len(raw), SLOT_BYTES):
        found = _parse(raw[at : at + SLOT_BYTES])
        if found is not None:
            records[at // SLOT_BYTES] = found
    return records
