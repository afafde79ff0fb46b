"""Who may open a cache directory, and how long an open may be stalled
(security review, findings 2 and 3(d)).

    a world-writable root            refused (anyone could plant links there)
    a root owned by another user     refused by the store and, run as root,
                                     by gc and npukv; --as-owner becomes
                                     the owner and works
    .lock held by another process    the open fails within lock_timeout_s,
                                     naming the holder's pid, not a hang
    leftover heap bytes              never written into index/data.mdb
                                     (LMDB's meminit)

Before the fix: every root was used as it was, a held ``.lock`` stalled
every open for good, and ``data.mdb`` held copies of freed heap buffers.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from npukv_store import ConfigError, KVStore
from npukv_store.cli import main as npukv_main
from npukv_store.cli.compact import main as maintenance_main
from tests.security import helpers
from tests.support.faults import SMALL, config

REPO = str(Path(__file__).resolve().parents[2])


def _refused(fn, *fragments: str) -> str:
    """Run ``fn``; it must raise one ConfigError naming every fragment."""
    try:
        fn()
    except ConfigError as exc:
        message = str(exc)
    else:
        raise AssertionError("not refused")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message, message
    return message


def test_a_world_writable_root_is_refused(attack, tmp_path):
    for mode in (0o777, 0o1777, 0o757):
        root = tmp_path / f"c{mode:o}"
        root.mkdir()
        root.chmod(mode)
        cfg = config(root)
        with attack(f"root: world-writable ({mode:04o}), then a store open"):
            _refused(
                lambda cfg=cfg: KVStore(cfg, SMALL).close(),
                str(root),
                "writable by every user",
            )
            assert os.listdir(root) == [], "the store wrote into it anyway"


def _make_cache_as(uid: int, root: str) -> None:
    """A cache of ``uid``'s at ``root``: the directory root made for it
    (chown), filled by a process of that user."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a second user's cache is made with chown/setuid")
    os.mkdir(root, 0o700)
    os.chown(root, uid, uid)
    done = helpers.as_user(uid, uid, lambda: helpers.filled_cache(root) and None)
    assert done.kind == "ok", done


def test_a_root_owned_by_another_user_is_refused_as_root(attack, tmp_path):
    with helpers.shared_base() as base:
        root = os.path.join(base, "cache")
        rings = os.path.join(base, "shm")
        os.mkdir(rings, 0o1777)
        _make_cache_as(helpers.OTHER_UID, root)
        before = helpers.snapshot(root)
        uid = helpers.OTHER_UID
        with attack("root: another user's cache, then a store open as root"):
            _refused(
                lambda: KVStore(config(root), SMALL).close(),
                root,
                f"owned by uid {uid}",
            )
        for name, argv, run in (
            ("gc", [root, "--gc-only", "--ring-dir", rings], maintenance_main),
            ("npukv stats", ["stats", root], npukv_main),
            ("npukv verify --fix", ["verify", root, "--fix"], npukv_main),
        ):
            with attack(f"root: another user's cache, then {name} as root"):
                done = helpers.bounded(lambda argv=argv, run=run: run(argv))
                assert done.kind == "refused", done
                assert f"owned by uid {uid}" in done.detail, done.detail
                assert "--as-owner" in done.detail, done.detail
        with attack("root: another user's cache, touched while refusing"):
            assert helpers.snapshot(root) == before


def test_as_owner_acts_as_the_owner(attack, tmp_path):
    with helpers.shared_base() as base:
        root = os.path.join(base, "cache")
        rings = os.path.join(base, "shm")
        os.mkdir(rings, 0o1777)
        _make_cache_as(helpers.OTHER_UID, root)
        argv = [root, "--gc-only", "--as-owner", "--ring-dir", rings]
        # The child cannot import what root's interpreter keeps in root's
        # 0700 home once it is uid 1234: import it all here first.
        own = os.path.join(base, "own")
        helpers.filled_cache(own)
        assert npukv_main(["stats", own]) == 0
        with attack("root: --as-owner leaves files of root's in the cache"):
            done = helpers.bounded(lambda: maintenance_main(argv))
            assert done.kind == "ok", done
            done = helpers.bounded(lambda: npukv_main(["stats", root, "--as-owner"]))
            assert done.kind == "ok", done
            assert os.path.exists(os.path.join(root, "maintenance.lock"))
            owners = {
                os.path.join(where, name): os.lstat(os.path.join(where, name)).st_uid
                for where, dirs, files in os.walk(root)
                for name in dirs + files
            }
            wrong = {p: u for p, u in owners.items() if u != helpers.OTHER_UID}
            assert not wrong, f"not uid {helpers.OTHER_UID}'s: {wrong}"


def _hold_lock(path: str) -> int:
    """A child holding LOCK_EX on ``path`` (opened read-only, as in the
    review); returns its pid once it holds it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(write_end, b"x")
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(write_end)
    assert os.read(read_end, 1) == b"x"
    os.close(read_end)
    return pid


def test_a_held_lock_fails_the_open_naming_the_holder(attack, tmp_path):
    root = str(tmp_path / "cache")
    helpers.filled_cache(root)
    holder = _hold_lock(os.path.join(root, ".lock"))
    try:
        with attack(".lock: held by another process, then a store open"):
            cfg = config(root, lock_timeout_s=1)
            # 15 s: a deadline to fail by; what it waited for is in the refusal
            done = helpers.bounded(helpers.store_open(cfg), timeout_s=15)
            assert done.kind != "hung", f"the open hung on .lock: {done.detail}"
            assert done.kind == "refused", done
            assert f"pid {holder}" in done.detail, done.detail
            # it gave up on .lock after its lock_timeout_s, not another wait
            assert "over 1 s (lock_timeout_s)" in done.detail, done.detail
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)


MEMINIT_CHILD = textwrap.dedent(
    """
    import os, sys
    from npukv_store import KVStore
    from tests.support.blocks import block_tensors
    from tests.support.faults import SMALL, config, keys_for
    MARK = b"PROMPT-TOKENS-OF-ANOTHER-REQUEST:"
    buffers = [bytearray(MARK * (4096 // len(MARK))) for _ in range(2000)]
    del buffers  # freed: their bytes stay in the heap for the next malloc
    with KVStore(config(sys.argv[1]), SMALL) as store:
        for batch in range(16):
            keys = keys_for(f"meminit:{batch}", 64)
            store.put(keys, block_tensors(SMALL, keys))
    with open(os.path.join(sys.argv[1], "index", "data.mdb"), "rb") as handle:
        print(handle.read().count(MARK))
    """
)


def test_freed_heap_bytes_never_reach_the_index(attack, tmp_path):
    """The review's repro, in a fresh process (a heap of known history)."""
    with attack("meminit: freed heap buffers written into index/data.mdb"):
        done = subprocess.run(
            [sys.executable, "-c", MEMINIT_CHILD, str(tmp_path / "cache")],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        copies = int(done.stdout.split()[-1])
        assert copies == 0, f"index/data.mdb holds {copies} copies of freed buffers"
