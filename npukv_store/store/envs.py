"""The LMDB environments of a cache directory (``index/``; ``claims/`` has
its own in :mod:`.claims`): one per path and process, opened safely.

Runs in: every process that opens the store, and the maintenance job.
Thread-safe.

    open_env()      - the process's environment for a path (refcounted,
                      reopened after a fork), its directory checked first
    release_env()   - drop a reference; the last one closes it
    check_env_dir() - create the directory with the access's mode, or check
                      it and its data.mdb / lock.mdb are ours, not symlinks
    fix_env_modes() - group mode: the file mode the umask took away

Why ``meminit=True``: LMDB otherwise writes the unused part of each fresh page
straight from malloc'd memory, which holds whatever the process freed before
(prompt token ids, request data), into a file other processes read
(docs/caveats.md). Measured with ``python -m bench store --quick``: see
``MEMINIT`` below.
"""

from __future__ import annotations

import os
import threading

import lmdb

from npukv_store.store.dirfd import DIR_FLAGS, check_entry
from npukv_store.store.permissions import Access

#: Zero each fresh page before LMDB writes it (see the module docstring).
MEMINIT = True
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_ENVS_LOCK = threading.Lock()
_ENVS: dict[str, tuple[int, lmdb.Environment, int]] = {}  # path -> (pid, env, refs)


def open_env(
    path: str, map_size: int, sync: bool, access: Access | None = None
) -> lmdb.Environment:
    """The process's environment for ``path``; reopened after a fork.

    Args:
        access: who may use the directory (default: private); its modes are
            the environment's, and what is already there must be its.

    Raises:
        UnsafeEntry: ``path`` or its files are symlinks or someone else's.
        lmdb.Error: LMDB could not open it.
    """
    access = Access() if access is None else access
    with _ENVS_LOCK:
        entry = _ENVS.get(path)
        if entry is not None and entry[0] == os.getpid():
            _ENVS[path] = (entry[0], entry[1], entry[2] + 1)
            return entry[1]
        check_env_dir(path, access)
        fresh = not os.path.lexists(os.path.join(path, "data.mdb"))
        env = lmdb.open(
            path,
            subdir=True,
            map_size=map_size,
            max_dbs=8,
            max_readers=1024,
            sync=sync,
            metasync=sync,
            readahead=False,
            meminit=MEMINIT,
            # LMDB gives its files this mode less the x bits: 0600 or 0660
            mode=access.dir_mode & 0o777,
        )
        fix_env_modes(path, access)
        if fresh and sync:
            # LMDB syncs data.mdb, never its name: a power cut could leave
            # an empty index in place of this one (docs/decisions/0071)
            fd = os.open(path, DIR_FLAGS)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        env.reader_check()  # free slots of readers killed without closing
        _ENVS[path] = (os.getpid(), env, 1)
        return env


def release_env(path: str) -> None:
    with _ENVS_LOCK:
        entry = _ENVS.get(path)
        if entry is None or entry[0] != os.getpid():
            return
        if entry[2] > 1:
            _ENVS[path] = (entry[0], entry[1], entry[2] - 1)
            return
        del _ENVS[path]
        entry[1].close()


def check_env_dir(path: str, access: Access) -> None:
    """Make ``path`` (``index/`` or ``claims/``) ready for ``lmdb.open``:
    create it with the access's mode, or check it is a directory of ours
    holding, if anything, regular files of ours named data.mdb / lock.mdb.

    LMDB opens by path and follows symlinks, so this is checked just before;
    a swap between this check and LMDB's open remains possible for whoever
    can write the root (nobody else with the default 0700, docs/caveats.md).
    It also creates the directory itself because LMDB would create it with
    the *file* mode (0600: no search bit, unusable).

    Raises:
        UnsafeEntry: naming what was found.
    """
    try:
        os.mkdir(path, access.dir_mode)
        created = True
    except FileExistsError:
        created = False
    if created:
        fd = os.open(path, DIR_FLAGS)
        try:
            access.fix_mode(fd, access.dir_mode)
        finally:
            os.close(fd)
    check_entry(path, os.lstat(path), access, directory=True)
    for name in ("data.mdb", "lock.mdb"):
        try:
            st = os.lstat(os.path.join(path, name))
        except FileNotFoundError:
            continue
        check_entry(os.path.join(path, name), st, access, directory=False)


def fix_env_modes(path: str, access: Access) -> None:
    """After ``lmdb.open``: LMDB creates its files with ``mode & ~umask``, so
    in group mode a umask of 022 leaves them 0640; give them 0660."""
    if access.gid is None:
        return
    for name in ("data.mdb", "lock.mdb"):
        try:
            fd = os.open(os.path.join(path, name), _FILE_FLAGS)
        except FileNotFoundError:
            continue
        try:
            access.fix_mode(fd, access.file_mode)
        finally:
            os.close(fd)
