"""The stale-ring scan (npukv_store/io/ring.py) meets things named like a ring
that are not ring files: a FIFO (a plain open of it blocks until a writer
comes: a worker's ring creation once hung on one left in /dev/shm) and a
symlink (it could point anywhere). The scan must return at once, skip them,
and leave them as they were, while still removing a real ring of a dead
process.

Every scan runs in a thread joined with a timeout, so a regression fails here
instead of hanging the suite; the FIFO is then opened for writing, which lets
a blocked open return and the thread end.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from npukv_store.errors import BadMagic
from npukv_store.io import ring as ring_mod
from npukv_store.io.ring import (
    ALIGN,
    NAME_PREFIX,
    StagingRing,
    read_ring_header,
    remove_stale_rings,
    stale_rings,
)

SCAN_TIMEOUT_S = 10.0


def _dead_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(child.stdout)


def _ring_file(path: Path, pid: int) -> None:
    header = struct.pack(
        "<8sIIQI", ring_mod.RING_MAGIC, ring_mod.RING_FORMAT,
        ring_mod.HEADER_BYTES, ALIGN, pid,
    )  # fmt: skip
    path.write_bytes(header.ljust(ring_mod.HEADER_BYTES + ALIGN, b"\0"))


@pytest.fixture
def scanned(tmp_path: Path) -> dict[str, Path]:
    """The scanned directory with, named like rings: a FIFO, a symlink to a
    ring file of a dead process kept elsewhere, a symlink to a FIFO kept
    elsewhere, and a real ring file of a dead process."""
    directory = tmp_path / "shm"
    elsewhere = tmp_path / "elsewhere"
    directory.mkdir()
    elsewhere.mkdir()
    dead = _dead_pid()
    paths = {
        "fifo": directory / f"{NAME_PREFIX}{dead}-fifo0000",
        "link": directory / f"{NAME_PREFIX}{dead}-link0000",
        "fifo_link": directory / f"{NAME_PREFIX}{dead}-link0001",
        "stale": directory / f"{NAME_PREFIX}{dead}-dead0000",
        "target": elsewhere / f"{NAME_PREFIX}{dead}-target00",
        "target_fifo": elsewhere / "fifo",
    }
    os.mkfifo(paths["fifo"], 0o600)
    os.mkfifo(paths["target_fifo"], 0o600)
    _ring_file(paths["target"], dead)
    _ring_file(paths["stale"], dead)
    os.symlink(paths["target"], paths["link"])
    os.symlink(paths["target_fifo"], paths["fifo_link"])
    paths["dir"] = directory
    return paths


def _in_thread(call: Callable[[], Any], fifos: list[Path]) -> Any:
    """``call()``'s result, run in a thread that must end within the timeout;
    on a hang the FIFOs get a writer (which ends a blocked open) and the test
    fails."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(SCAN_TIMEOUT_S)
    hung = thread.is_alive()
    if hung:
        for fifo in fifos:  # a reader blocked in open() returns once a writer opens
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(SCAN_TIMEOUT_S)
    assert not hung, f"the ring scan blocked for {SCAN_TIMEOUT_S} s"
    if errors:
        raise errors[0]
    return out[0]


def _untouched(paths: dict[str, Path]) -> None:
    assert stat.S_ISFIFO(os.lstat(paths["fifo"]).st_mode)
    assert stat.S_ISFIFO(os.lstat(paths["target_fifo"]).st_mode)
    for name, target in (("link", "target"), ("fifo_link", "target_fifo")):
        assert os.path.islink(paths[name]), f"the {name} symlink was removed"
        assert os.readlink(paths[name]) == str(paths[target])
    assert paths["target"].stat().st_size == ring_mod.HEADER_BYTES + ALIGN


def test_scan_skips_a_fifo_and_symlinks_named_like_rings(scanned):
    fifos = [scanned["fifo"], scanned["target_fifo"]]
    found = _in_thread(lambda: stale_rings(str(scanned["dir"])), fifos)
    assert found == [str(scanned["stale"])]  # the symlinks were not followed
    removed = _in_thread(lambda: remove_stale_rings(str(scanned["dir"])), fifos)
    assert removed == 1
    assert not scanned["stale"].exists()
    _untouched(scanned)


def test_creating_a_ring_beside_a_fifo_named_like_one_does_not_block(scanned):
    """As in a worker's start-up: the new ring's own cleanup scan."""
    fifos = [scanned["fifo"], scanned["target_fifo"]]
    ring = _in_thread(lambda: StagingRing(ALIGN, directory=str(scanned["dir"])), fifos)
    try:
        assert os.path.exists(ring.path)
        assert not scanned["stale"].exists()
        _untouched(scanned)
    finally:
        ring.close()


def test_read_ring_header_refuses_what_is_not_a_regular_file(scanned):
    fifos = [scanned["fifo"], scanned["target_fifo"]]
    with pytest.raises(BadMagic, match="not a regular file"):
        _in_thread(lambda: read_ring_header(str(scanned["fifo"])), fifos)
    with pytest.raises(OSError, match="Too many levels of symbolic links") as refused:
        read_ring_header(str(scanned["link"]))  # O_NOFOLLOW
    assert refused.value.errno == errno.ELOOP
    assert read_ring_header(str(scanned["target"]))[0] == ALIGN
