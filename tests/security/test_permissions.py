"""The modes a cache is made with (security review, finding 2): a chunk file
gives its prompt away, so by default nothing the store or the maintenance
job creates has a group or other bit, whatever the umask; with
``cache_group`` directories are 2770 and files 0660, never a world bit.
LMDB's files included.

Before the fix: with umask 022 the root, ``<ns>/chunks`` and ``index/`` came
out 0755 and the chunk files, ``index/data.mdb``, ``claims/data.mdb``,
``.lock`` and the marker 0644.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

import pytest

from npukv_store import KVStore
from npukv_store.maintenance import Options, run
from tests.security import helpers
from tests.support import faults
from tests.support.blocks import block_tensors
from tests.support.chunks import chunk_files
from tests.support.faults import SMALL, config, keys_for

#: What a used cache holds: every one must exist for the test to mean much.
EXPECTED = (
    "NPUKV_STORE", ".lock", "sessions", "boot", "maintenance.lock", "secret", "tmp",
    "index",
    "index/data.mdb", "index/lock.mdb", "claims", "claims/data.mdb",
    "claims/lock.mdb", "quarantine",
)  # fmt: skip


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _use(root: str, rings: str, **kw: object) -> dict[str, os.stat_result]:
    """Puts, claims, a corrupt chunk, then a maintenance run (gc, verify,
    compaction): every kind of file the cache has. Returns path -> lstat."""
    cfg = config(root, **kw)
    with KVStore(cfg, SMALL) as store:
        for tag in range(3):
            keys = keys_for(f"{root}:{tag}", 4)
            store.put(keys, block_tensors(SMALL, keys))
    victim = sorted(chunk_files(root).values())[0]
    faults.flip_bit(victim, faults.data_start(victim) + 3, 1)
    run(Options(cache_dir=root, verify=True, min_live=1.0, ring_dir=rings))
    found = {root: os.lstat(root)}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            found[os.path.join(where, name)] = os.lstat(os.path.join(where, name))
    for name in EXPECTED:
        assert os.path.join(root, name) in found, f"the run made no {name}"
    assert os.listdir(os.path.join(root, "quarantine")), "nothing quarantined"
    return found


def _modes(found: dict[str, os.stat_result], bad: int) -> list[str]:
    return [
        f"{path}: {stat.S_IMODE(st.st_mode):04o}"
        for path, st in sorted(found.items())
        if st.st_mode & bad
    ]


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o000])
def test_private_cache_has_no_group_or_other_bits(attack, tmp_path, mask):
    rings = str(tmp_path / "shm")
    os.mkdir(rings)
    with attack(f"modes: another user reads a new cache (umask {mask:03o})"):
        with _umask(mask):
            found = _use(str(tmp_path / "cache"), rings)
        leaks = _modes(found, 0o077)
        assert not leaks, f"readable or writable by others: {leaks[:5]}"


def test_group_cache_is_2770_and_0660(attack, tmp_path):
    rings = str(tmp_path / "shm")
    os.mkdir(rings)
    gid = os.getegid()
    with attack("modes: a group cache with a world bit or a member locked out"):
        with _umask(0o022):  # takes g+w away unless the store puts it back
            found = _use(str(tmp_path / "cache"), rings, cache_group=str(gid))
        assert not _modes(found, 0o007), _modes(found, 0o007)
        wrong = [
            f"{path}: {stat.S_IMODE(st.st_mode):04o} gid {st.st_gid}"
            for path, st in sorted(found.items())
            if stat.S_IMODE(st.st_mode)
            != (0o2770 if stat.S_ISDIR(st.st_mode) else 0o660)
            or st.st_gid != gid
        ]
        assert not wrong, f"expected dirs 2770 and files 0660 of gid {gid}: {wrong}"


def _group_mode(st: os.stat_result) -> int:
    return 0o2770 if stat.S_ISDIR(st.st_mode) else 0o660


def test_another_user_cannot_take_the_directory_lock(attack, tmp_path):
    """The review's 3(d): a user who can open ``.lock`` can hold it for good
    and stall every store open."""
    with helpers.shared_base() as base:
        root = os.path.join(base, "cache")
        with _umask(0o022):
            helpers.filled_cache(root)

        def take_lock() -> int:
            import fcntl

            fd = os.open(os.path.join(root, ".lock"), os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return 0

        with attack("modes: another user takes .lock"):
            done = helpers.as_user(helpers.OTHER_UID, helpers.OTHER_UID, take_lock)
            assert done.kind == "error", f"uid {helpers.OTHER_UID} took it: {done}"
            assert "PermissionError" in done.detail, done.detail
            lock = os.lstat(os.path.join(root, ".lock"))
            assert not lock.st_mode & 0o077, f".lock is {lock.st_mode & 0o777:04o}"
