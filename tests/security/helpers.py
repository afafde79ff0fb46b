"""What the security tests share: a small filled cache, a snapshot of a
directory outside it, and running one operation in a forked child with a
time bound (a link followed into a FIFO hangs it: that is an escape, not a
test that never ends).

    filled_cache()  - a cache with two chunks of SMALL; returns its config
    snapshot()      - every path under a directory -> what it is and holds
    bounded()       - run a callable in a forked child: its outcome, or "hung"
    as_user()       - run a callable in a forked child as another uid (root only)
    OPERATIONS      - gc, a store open, verify --fix, rebuild-index
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.cli import main as npukv_main
from npukv_store.cli.compact import main as maintenance_main
from npukv_store.errors import ConfigError
from tests.support.blocks import block_tensors
from tests.support.faults import SMALL, config, keys_for

#: A uid and gid no account of this machine uses (the review's attacker).
OTHER_UID = 1234


def filled_cache(root: str, **kw: Any) -> StoreConfig:
    """A cache at ``root`` with two chunks of SMALL (4 blocks each)."""
    cfg = config(root, **kw)
    with KVStore(cfg, SMALL) as store:
        for tag in ("a", "b"):
            keys = keys_for(f"{root}:{tag}", 4)
            store.put(keys, block_tensors(SMALL, keys))
    return cfg


def snapshot(top: str) -> dict[str, tuple[Any, ...]]:
    """Every path under ``top`` (``top`` itself included), never followed:
    its kind and mode, and a file's bytes or a symlink's target."""
    found: dict[str, tuple[Any, ...]] = {top: _entry(top)}
    for where, dirs, files in os.walk(top):  # symlinks to dirs: not entered
        for name in dirs + files:
            path = os.path.join(where, name)
            found[path] = _entry(path)
    return found


def _entry(path: str) -> tuple[Any, ...]:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return ("link", os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return ("dir", stat.S_IMODE(st.st_mode))
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as handle:
            return ("file", stat.S_IMODE(st.st_mode), handle.read())
    return ("other", stat.S_IFMT(st.st_mode))


@dataclass(frozen=True)
class Outcome:
    """What one operation did in its child: ``ok`` (returned ``code``),
    ``refused`` (a ConfigError, or exit code 2, with ``detail``), ``error``
    (anything else raised), ``hung`` (still running at the bound)."""

    kind: str
    detail: str = ""
    code: int | None = None


def bounded(fn: Callable[[], int | None], timeout_s: float = 30.0) -> Outcome:
    """Run ``fn`` in a forked child and report how it ended.

    ``fn`` returns an exit code (None: 0); code 2 counts as refused, with
    what it printed on stderr as the detail.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without pytest's teardown
        status = 0
        try:
            os.close(read_end)
            err = io.StringIO()
            try:
                with (
                    contextlib.redirect_stderr(err),
                    contextlib.redirect_stdout(io.StringIO()),
                ):
                    code = fn() or 0
                kind = "refused" if code == 2 else "ok"
                out = {"kind": kind, "detail": err.getvalue(), "code": code}
            except ConfigError as exc:
                out = {"kind": "refused", "detail": str(exc)}
            except BaseException as exc:
                out = {"kind": "error", "detail": f"{type(exc).__name__}: {exc}"}
            out["detail"] = out["detail"][-4000:]
            os.write(write_end, json.dumps(out).encode())
        except BaseException:
            status = 3
        finally:
            os._exit(status)
    os.close(write_end)
    deadline = time.monotonic() + timeout_s
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return Outcome("hung", f"still running after {timeout_s:g} s")
            time.sleep(0.02)
        with os.fdopen(read_end, "rb") as handle:
            read_end = -1
            raw = handle.read()
    finally:
        if read_end >= 0:
            os.close(read_end)
    if not raw:
        return Outcome("error", "the child died without a report")
    body = json.loads(raw)
    return Outcome(body["kind"], body["detail"], body.get("code"))


def as_user(uid: int, gid: int, fn: Callable[[], int | None]) -> Outcome:
    """:func:`bounded`, with the child switched to ``uid``/``gid`` first."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a second user's process is made with setuid")

    def switched() -> int | None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        return fn()

    return bounded(switched)


@contextlib.contextmanager
def shared_base() -> Iterator[str]:
    """A fresh directory another uid can reach (pytest's tmp dirs are under
    root's 0700 one), removed afterwards."""
    base = tempfile.mkdtemp(prefix="npukv-security-")
    os.chmod(base, 0o711)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def gc(root: str, rings: str) -> Callable[[], int]:
    return lambda: maintenance_main([root, "--gc-only", "--ring-dir", rings])


def store_open(cfg: StoreConfig) -> Callable[[], None]:
    def run() -> None:
        KVStore(cfg, SMALL).close()

    return run


def verify_fix(root: str) -> Callable[[], int]:
    return lambda: npukv_main(["verify", root, "--fix"])


def rebuild_index(root: str) -> Callable[[], int]:
    return lambda: npukv_main(["rebuild-index", root])


def operations(cfg: StoreConfig, rings: str) -> dict[str, Callable[[], Any]]:
    """The four ways into a cache the review attacked."""
    root = str(cfg.cache_dir)
    return {
        "gc": gc(root, rings),
        "store open": store_open(cfg),
        "verify --fix": verify_fix(root),
        "rebuild-index": rebuild_index(root),
    }
