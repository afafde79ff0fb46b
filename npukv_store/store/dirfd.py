"""Every file operation inside a cache directory, relative to one descriptor
of its root: no path outside the cache is ever touched.

Runs in: any process with a :class:`~npukv_store.store.directory.CacheDir`
(its base class); thread-safe (the root fd is opened once, under a lock).

    DirFD.fd            - the root, opened once with O_DIRECTORY | O_NOFOLLOW
    DirFD.open_file()   - open a file (O_NOFOLLOW, created with the access's mode)
    DirFD.unlink() / rename() / link() / lstat() / listdir() / make_dir()
    DirFD.subdir()      - a directory of the cache as an fd, for a batch of calls
    UnsafeEntry         - a symlink, or another user's entry, where the layout
                          has one of ours: refused, never followed

Why: a user who can write the cache directory (a group member, or anyone if
it was left world-writable) could swap ``tmp/``, ``index/``, a lock file or a
chunk for a symlink, and every gc and store open would then delete, truncate
or create files wherever it points, with the rights of whoever runs it
(root's cron job, say). So paths given to this class, absolute under the
root or relative to it, are walked one component at a time with
``O_DIRECTORY | O_NOFOLLOW`` from the root's fd, each directory checked to be
ours (:meth:`Access.owns`) and not world-writable, and the last step is an
``*at()`` call that never follows a symlink either. The root itself is never
looked up by path again after its first open. What cannot be done this way,
LMDB's open by path, is checked just before (:mod:`.envs`); the race that
leaves is in docs/caveats.md.

Not guaranteed: a file's *contents* are not trusted by this module; chunk
readers verify them as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from npukv_store.errors import ConfigError
from npukv_store.store.permissions import Access

#: Flags of every directory step: never a symlink, never kept across exec.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeEntry(ConfigError, OSError):
    """An entry of the cache directory is not what the layout says (a symlink,
    a file where a directory belongs, another user's): refused, never
    followed. Both a ConfigError (one clear error at open) and an OSError (a
    reader's miss, as any unreadable file)."""


def describe(st: os.stat_result) -> str:
    """What an entry is, in words (for the messages)."""
    for test, words in (
        (stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):  # fmt: skip
        if test(st.st_mode):
            return words
    return "a device file"


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def check_entry(
    path: str,
    st: os.stat_result,
    access: Access,
    *,
    directory: bool,
    single_link: bool = False,
) -> None:
    """Refuse an entry that is not ours or not of the kind expected;
    ``single_link``: nor a file with other hard links (one we write to: the
    write would land in the other name's file too).

    Raises:
        UnsafeEntry: naming ``path``, what it is and what was expected.
    """
    kind = "a directory" if directory else "a regular file"
    wanted = stat.S_ISDIR if directory else stat.S_ISREG
    if not wanted(st.st_mode):
        raise UnsafeEntry(
            f"cache_dir: {path} is {describe(st)}, expected {kind} of the cache "
            "(never followed: remove it)"
        )
    if not access.owns(st):
        raise UnsafeEntry(
            f"cache_dir: {path} is owned by uid {st.st_uid} gid {st.st_gid}, "
            f"expected uid {os.geteuid()}"
            + ("" if access.gid is None else f" or gid {access.gid} (cache_group)")
        )
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeEntry(
            f"cache_dir: {path} is writable by every user (mode {_mode(st)}), "
            f"expected {access.dir_mode if directory else access.file_mode:04o} "
            "(chmod o-w it)"
        )
    if single_link and st.st_nlink != 1:
        raise UnsafeEntry(f"cache_dir: {path} has {st.st_nlink} hard links, expected 1")


class DirFD:
    """The root of a cache directory as a descriptor, and the operations
    relative to it (see the module docstring)."""

    def __init__(self, root: str, access: Access | None) -> None:
        """``access`` None: take the root's (:meth:`Access.of_root`) when it
        is opened; private for a root this process creates."""
        self.root = os.path.abspath(root)
        self._access = access
        self._fd: int | None = None
        self._closer: Callable[[], Any] | None = None  # closes _fd once
        self._fd_lock = threading.Lock()
        self.root_stat: os.stat_result | None = None  # at the root's open

    @property
    def access(self) -> Access:
        if self._access is None:
            self.fd  # noqa: B018 - opening the root settles the access
        assert self._access is not None
        return self._access

    @property
    def fd(self) -> int:
        """The root's descriptor (opened, not created, on first use)."""
        fd = self._fd
        return fd if fd is not None else self.open_root(create=False)

    def open_root(self, *, create: bool) -> int:
        """(Re)open the root: after a fork, a store reopens everything.

        Raises:
            ConfigError: the root is a file, a symlink, world-writable or
                someone else's (:meth:`Access.check_root`).
            OSError: it is missing (``create`` False) or cannot be made.
        """
        with self._fd_lock:
            access = self._access or Access()
            made = create and self._make_root(access)
            try:
                fd = os.open(self.root, DIR_FLAGS)
            except OSError as exc:
                raise self._root_error(exc) from None
            try:
                if made or access.gid is not None:
                    # group mode on a root of ours: the group gets it whole
                    # (2770), or its other members could not use it
                    access.fix_mode(fd, access.dir_mode)
                st = os.fstat(fd)
                if self._access is None:
                    self._access = Access.of_root(st)
                self._access.check_root(self.root, st)
            except BaseException:
                os.close(fd)
                raise
            # A previous fd (the parent's, after a fork) is not closed here:
            # another thread may still hold its number for an *at() call,
            # and a reused number would point that call elsewhere. Its
            # finalizer closes it with this object.
            self._fd = fd
            self._closer = weakref.finalize(self, os.close, fd)
            self.root_stat = st
            return fd

    def _make_root(self, access: Access) -> bool:
        """Create the root (and its missing parents, with the default mode:
        they are not the cache's); whether this call created it."""
        for attempt in (0, 1):
            try:
                os.mkdir(self.root, access.dir_mode)
                return True
            except FileExistsError:
                return False
            except FileNotFoundError:
                if attempt:
                    raise
                # (a parent that is a file fails here, naming the root)
                os.makedirs(os.path.dirname(self.root), exist_ok=True)
        return False

    def _root_error(self, exc: OSError) -> Exception:
        try:
            st = os.lstat(self.root)
        except OSError:
            return exc
        if stat.S_ISLNK(st.st_mode):
            return ConfigError(
                f"cache_dir: {self.root} is a symlink to "
                f"{os.readlink(self.root)!r}; expected a directory (a symlinked "
                "root is not followed: give its target)"
            )
        if not stat.S_ISDIR(st.st_mode):
            return ConfigError(
                f"cache_dir: {self.root} is a file, expected a directory"
            )
        return exc

    def close(self) -> None:
        """Close the root's descriptor (it is reopened on next use)."""
        with self._fd_lock:
            if self._closer is not None:
                self._closer()  # closes the fd once, however often called
            self._fd, self._closer = None, None

    # -- paths ------------------------------------------------------------------

    def full(self, path: str) -> str:
        """``path`` (relative to the root, or absolute under it) as absolute."""
        return os.path.join(self.root, self.parts(path)[0])

    def parts(self, path: str) -> tuple[str, list[str]]:
        """``(relative path, components)`` of a path inside the cache.

        Raises:
            ValueError: the path leads outside the cache (an internal bug:
                every name we build is hex or fixed).
        """
        rel = os.path.relpath(path, self.root) if os.path.isabs(path) else path
        parts = rel.split(os.sep)
        if not parts or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{path}: not a path inside {self.root}")
        return rel, parts

    @contextlib.contextmanager
    def subdir(self, path: str = "") -> Iterator[int]:
        """A descriptor of the cache's directory ``path`` ("" is the root),
        reached without following a symlink, each step checked to be ours.

        Raises:
            FileNotFoundError: a component is missing (naming the full path).
            UnsafeEntry: a component is a symlink, not a directory, or not ours.
        """
        root = self.fd
        fd = root
        try:
            if path:
                walked = self.root
                for name in self.parts(path)[1]:
                    walked = os.path.join(walked, name)
                    child = self._step(fd, name, walked)
                    if fd != root:
                        os.close(fd)
                    fd = child
            yield fd
        finally:
            if fd != root:
                os.close(fd)

    def _step(self, parent: int, name: str, full: str) -> int:
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                check_entry(full, st, self.access, directory=True)
            raise type(exc)(exc.errno, exc.strerror, full) from None
        try:
            check_entry(full, os.fstat(fd), self.access, directory=True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def parent(self, path: str) -> Iterator[tuple[int, str]]:
        """``(fd of the directory holding path, its last component)``."""
        rel, parts = self.parts(path)
        with self.subdir(os.sep.join(parts[:-1])) as fd:
            yield fd, parts[-1]

    # -- operations ---------------------------------------------------------------

    def open_file(self, path: str, flags: int, mode: int | None = None) -> int:
        """``os.open`` of a file of the cache, never through a symlink.

        A file this call creates gets ``mode`` (default: the access's file
        mode) whatever the umask. Errors name the full path.

        Raises:
            UnsafeEntry: the file, or a directory on the way, is a symlink
                or not of the kind expected.
            OSError: as ``os.open``.
        """
        mode = self.access.file_mode if mode is None else mode
        with self.parent(path) as (dir_fd, name):
            try:
                fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
            except OSError as exc:
                raise self._entry_error(exc, dir_fd, name, path) from None
        if flags & os.O_CREAT:
            try:
                self.access.fix_mode(fd, mode)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _entry_error(
        self, exc: OSError, dir_fd: int, name: str, path: str
    ) -> Exception:
        if exc.errno == errno.ELOOP:
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                return UnsafeEntry(
                    f"cache_dir: {self.full(path)} is {describe(st)}, expected a "
                    "regular file of the cache (never followed)"
                )
        return type(exc)(exc.errno, exc.strerror, self.full(path))

    def unlink(self, path: str) -> None:
        """Remove a file (a symlink is removed itself, never its target)."""
        with self.parent(path) as (dir_fd, name):
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError as exc:
                raise type(exc)(exc.errno, exc.strerror, self.full(path)) from None

    def unlink_quietly(self, path: str) -> bool:
        """:meth:`unlink`; already gone is the same outcome. Returns whether
        this call removed it."""
        try:
            self.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def rename(self, source: str, target: str) -> None:
        """``rename()`` between two directories of the cache (a symlink is
        moved itself; a symlinked directory on the way is refused)."""
        with self.parent(source) as (src_fd, src), self.parent(target) as (dst_fd, dst):
            try:
                os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            except OSError as exc:
                raise type(exc)(
                    exc.errno, exc.strerror, self.full(source), None, self.full(target)
                ) from None

    def link(self, source: str, target: str) -> None:
        """``link()`` (fails with FileExistsError when ``target`` exists)."""
        with self.parent(source) as (src_fd, src), self.parent(target) as (dst_fd, dst):
            try:
                os.link(
                    src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd,
                    follow_symlinks=False,
                )  # fmt: skip
            except OSError as exc:
                raise type(exc)(
                    exc.errno, exc.strerror, self.full(source), None, self.full(target)
                ) from None

    def lstat(self, path: str) -> os.stat_result | None:
        """The entry's own stat (a symlink's, not its target's); None if missing."""
        try:
            with self.parent(path) as (dir_fd, name):
                return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def listdir(self, path: str = "") -> list[str]:
        """Names in a directory of the cache; [] when it is missing."""
        try:
            with self.subdir(path) as fd:
                return os.listdir(fd)
        except FileNotFoundError:
            return []

    def make_dir(self, path: str) -> None:
        """Create a directory of the cache (its parent must exist) with the
        access's mode, or check that the one there is ours.

        Raises:
            UnsafeEntry: something else is there.
        """
        with self.parent(path) as (dir_fd, name):
            try:
                os.mkdir(name, self.access.dir_mode, dir_fd=dir_fd)
                # its name durable before anything is published under it: a
                # power cut otherwise loses the directory with its synced
                # files (docs/decisions/0071); once per directory
                os.fsync(dir_fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise type(exc)(exc.errno, exc.strerror, self.full(path)) from None
        with self.subdir(path) as fd:  # checks what is there, ours or not
            self.access.fix_mode(fd, self.access.dir_mode)

    def sync_dir(self, path: str = "") -> None:
        """fsync a directory of the cache (the root by default): the names
        made or removed in it survive a power cut (docs/decisions/0071)."""
        with self.subdir(path) as fd:
            os.fsync(fd)

    def check_entries(self, dirs: tuple[str, ...], files: tuple[str, ...]) -> None:
        """Refuse a root-level entry of the layout that is not what it should be.

        Raises:
            UnsafeEntry: naming the first one found.
        """
        for names, directory in ((dirs, True), (files, False)):
            for name in names:
                st = self.lstat(name)
                if st is not None:
                    check_entry(self.full(name), st, self.access, directory=directory)
