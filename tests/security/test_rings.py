"""No stall from outside: what another local user can leave in /dev/shm under
a staging ring's name (npukv_store/io/ring.py) must neither block nor fail a
worker's ring creation or gc's stale-ring scan (security review, finding 3).

A tmp directory stands in for /dev/shm (StagingRing and the scan take the
directory). Every scan and every ring creation runs in a thread or a child
with a deadline, so a regression fails here instead of hanging the suite;
every child is waited for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from npukv_store.io import ring as ring_mod
from npukv_store.io.ring import ALIGN, NAME_PREFIX, StagingRing, scan_rings
from npukv_store.liveness import pid_alive, safe_pid

#: A deadline to fail by for one ring creation or scan: an open that blocks
#: on a FIFO never returns by itself, so this is generous (not a timing).
DEADLINE_S = 30.0
ATTACKER_UID = 1234
VICTIM_UID = 65534


def _dead_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return int(child.stdout)


def _ring_bytes(pid: int) -> bytes:
    header = struct.pack(
        "<8sIIQI", ring_mod.RING_MAGIC, ring_mod.RING_FORMAT,
        ring_mod.HEADER_BYTES, ALIGN, pid,
    )  # fmt: skip
    return header.ljust(ring_mod.HEADER_BYTES + ALIGN, b"\0")


def _within(call: Callable[[], Any], fifos: Sequence[Path] = ()) -> Any:
    """``call()``'s result; it must return within DEADLINE_S. On a hang the
    FIFOs get a writer (which ends a blocked open) so the thread ends."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    hung = thread.is_alive()
    if hung:  # a writer for each FIFO ends a blocked open
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    if errors:
        raise errors[0]
    assert not hung, f"still blocked after {DEADLINE_S} s (a FIFO's open?)"
    return out[0]


def _create_and_scan(directory: Path, fifos: Sequence[Path] = ()) -> None:
    """A ring is created beside whatever is there, and a scan returns, each
    within the deadline and without raising."""
    ring = _within(lambda: StagingRing(ALIGN, directory=str(directory)), fifos)
    try:
        assert os.path.exists(ring.path)
        assert ring.reserve(ALIGN) is not None
        scan = _within(lambda: scan_rings(str(directory)), fifos)
        assert ring.path not in scan.stale  # ours, and alive
    finally:
        ring.close()


def test_a_fifo_named_like_a_ring_stalls_nothing(attack, tmp_path):
    fifo = tmp_path / f"{NAME_PREFIX}{_dead_pid()}-f1f0f1f0"
    os.mkfifo(fifo, 0o600)
    with attack("shm: FIFO named like a ring"):
        before = ring_mod.skipped_foreign
        _create_and_scan(tmp_path, [fifo])
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was removed"
        assert ring_mod.skipped_foreign > before, "the FIFO was not counted"


def test_a_symlink_named_like_a_ring_is_not_followed(attack, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shm = tmp_path / "shm"
    shm.mkdir()
    target = elsewhere / "victim"
    planted = _ring_bytes(_dead_pid())
    target.write_bytes(planted)  # looks like a stale ring
    link = shm / f"{NAME_PREFIX}{_dead_pid()}-11111111"
    link.symlink_to(target)
    dir_link = shm / f"{NAME_PREFIX}1-22222222"
    dir_link.symlink_to(elsewhere)
    with attack("shm: symlink named like a ring"):
        scan = _within(lambda: scan_rings(str(shm)))
        assert scan.stale == []
        assert scan.skipped_foreign == 2
        _create_and_scan(shm)
        assert link.is_symlink()
        assert dir_link.is_symlink()
        assert target.read_bytes() == planted


def test_a_ring_header_with_pid_2_32_minus_1_is_a_dead_ring(attack, tmp_path):
    ring_file = tmp_path / f"{NAME_PREFIX}{os.getpid()}-ffffffff"
    ring_file.write_bytes(_ring_bytes(0xFFFFFFFF))
    with attack("shm: ring header pid 0xFFFFFFFF"):
        assert _within(lambda: scan_rings(str(tmp_path))).stale == [str(ring_file)]
        _create_and_scan(tmp_path)
        assert not ring_file.exists(), "our own ring of no possible owner stayed"


def test_a_ring_name_with_a_pid_of_2_31_or_more(attack, tmp_path):
    dead = _dead_pid()
    names = [f"{NAME_PREFIX}{2**31}-aaaaaaaa", f"{NAME_PREFIX}{2**64}-bbbbbbbb",
             f"{NAME_PREFIX}{'9' * 200}-cccccccc"]  # fmt: skip
    for name in names:
        (tmp_path / name).write_bytes(_ring_bytes(dead))
    with attack("shm: ring name with pid >= 2**31"):
        _create_and_scan(tmp_path)
        assert [n for n in names if (tmp_path / n).exists()] == []


def test_a_ring_name_taken_before_creation_is_retried(attack, tmp_path, monkeypatch):
    """Ring creation survives its own name being taken (a planted FIFO, a
    symlink, another user's leftover): it tries a fresh random name."""
    tokens = iter(["taken000", "taken001", "free0000"])
    monkeypatch.setattr(ring_mod.secrets, "token_hex", lambda _n: next(tokens))
    os.mkfifo(tmp_path / f"{NAME_PREFIX}{os.getpid()}-taken000", 0o600)
    (tmp_path / f"{NAME_PREFIX}{os.getpid()}-taken001").symlink_to(tmp_path / "x")
    with attack("shm: ring name taken"):
        ring = _within(lambda: StagingRing(ALIGN, directory=str(tmp_path)))
        try:
            assert ring.path.endswith("-free0000")
            assert not (tmp_path / "x").exists(), "created through the symlink"
        finally:
            ring.close()


@pytest.mark.parametrize("pid", [-1, 0, 2**22 + 1, 2**31, 2**32 - 1, 2**63, 2**200])
def test_pid_alive_is_total(attack, pid):
    with attack("liveness: pid out of range"):
        assert pid_alive(pid) is False
        assert safe_pid(pid) is None
        assert safe_pid(str(pid)) is None


def test_safe_pid_takes_only_what_getpid_writes(attack):
    with attack("liveness: pid text"):
        assert safe_pid(str(os.getpid())) == os.getpid()
        assert safe_pid(b"1") == 1
        bad_pids = ["", " 1", "+1", "1_0", "\u0663", "9" * 5000, "1e3", True, 1.0, None]
        for bad in bad_pids:
            assert safe_pid(bad) is None, bad


# -- another user's ring, in a sticky directory like /dev/shm -----------------


@pytest.fixture
def sticky_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root: rings of two other uids (setuid children)")
    path = Path(tempfile.mkdtemp(prefix="npukv-shm-"))
    os.chmod(path, 0o1777)  # like /dev/shm
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _in_child(uid: int, work: Callable[[], int], timeout_s: float = 30.0) -> int:
    """Run ``work`` in a forked child as ``uid``; its return value is the
    child's exit status. The child is always waited for; one still running
    after ``timeout_s`` is killed, and the status is then -1."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            os.setgid(uid)
            os.setuid(uid)
            code = work()
        except BaseException:  # noqa: BLE001 - reported as the exit status
            code = 98
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1
        time.sleep(0.01)


def test_another_users_stale_ring_is_left_alone(attack, sticky_dir):
    """uid 1234 leaves a ring of a dead process in the sticky directory;
    uid 65534 then creates its ring there (unlinking the other's ring would be
    EPERM, once turning the connector off) and scans it (gc)."""
    dead = _dead_pid()
    foreign = sticky_dir / f"{NAME_PREFIX}{dead}-0f0f0f0f"

    def plant() -> int:
        fd = os.open(foreign, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, _ring_bytes(dead))
        os.close(fd)
        return 0

    def victim() -> int:  # one that blocks is killed by _in_child's deadline
        ring = StagingRing(ALIGN, directory=str(sticky_dir))
        scan = scan_rings(str(sticky_dir))
        ring.close()
        if scan.stale or scan.skipped_foreign != 1 or ring.skipped_foreign != 1:
            return 3  # another user's ring was judged, or not counted
        return 0

    assert _in_child(ATTACKER_UID, plant) == 0
    assert os.stat(foreign).st_uid == ATTACKER_UID
    with attack("shm: another user's stale ring"):
        status = _in_child(VICTIM_UID, victim)
        assert status == 0, f"the victim's ring creation ended with {status}"
        assert foreign.exists(), "another user's ring was removed"
