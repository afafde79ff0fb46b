"""The cache directory: its marker, paths, open-time lock and garbage rules.

Runs in: any process opening a store, and the maintenance job.

    CacheDir.open()      - create (0700, or 2770 with cache_group) or check
                           the root, its entries and the NPUKV_STORE marker
    CacheDir.open_existing() - the same for the tools, creating nothing
    CacheDir.locked()    - the directory-wide flock held while recovering,
                           waited for at most lock_timeout_s
    CacheDir.tmp_path()  - a fresh in-flight file name that carries its pid
    CacheDir.garbage_tmp() - tmp/ files whose writer is dead or that are too old
    CacheDir.read_secret() - the directory's secret, made on first use
    creator_alive()      - whether a chunk's writer may still publish it

Every file operation is relative to the root's descriptor and never follows
a symlink (:mod:`.dirfd`); what is created gets the access's mode
(:mod:`.permissions`), never a world bit.

Layout (docs/format.md)::

    <cache_dir>/NPUKV_STORE               marker: {"magic", "format_version", ...}
    <cache_dir>/index/                    the LMDB index
    <cache_dir>/claims/                   save claims (LMDB, never fsynced)
    <cache_dir>/quarantine/               corrupt chunks, kept for inspection
    <cache_dir>/maintenance.lock          flock: one maintenance run at a time
    <cache_dir>/<ns>/namespace.json       the namespace spec, human-readable
    <cache_dir>/<ns>/chunks/<id>.safetensors
    <cache_dir>/tmp/<pid>-<id>.tmp        in-flight files
    <cache_dir>/.lock                     flock: recovery and index rebuilds;
                                          byte locks: signs of life (.locks)
    <cache_dir>/sessions                  open store handles (.sessions)
    <cache_dir>/boot                      the boot id of the last open (.sessions)
    <cache_dir>/secret                    32 random bytes: the chain key's seed
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from npukv_store.errors import (
    BadMagic,
    ConfigError,
    NamespaceMismatch,
    VersionMismatch,
)
from npukv_store.keying import CACHE_SECRET_FILE, SECRET_BYTES, read_secret_file
from npukv_store.liveness import pid_alive, safe_pid
from npukv_store.spec import FORMAT_VERSION
from npukv_store.store.dirfd import DirFD, UnsafeEntry, check_entry
from npukv_store.store.locks import open_lock_file, wait_for_lock
from npukv_store.store.permissions import Access

if TYPE_CHECKING:
    from npukv_store.config import StoreConfig

logger = logging.getLogger(__name__)

MARKER = "NPUKV_STORE"
MARKER_MAGIC = "npukv_store"
HOST = socket.gethostname()
_TMP_RE = re.compile(r"^(\d+)-[0-9a-f]+\.tmp$")
_CHUNK_RE = re.compile(r"^([0-9a-f]{16})\.safetensors$")
_NS_RE = re.compile(r"^[0-9a-f]{32}$")
#: Root-level entries of the layout, checked at every open: a symlink or
#: another user's entry there is refused (docs/caveats.md).
ENTRY_DIRS = ("tmp", "index", "claims", "quarantine")
ENTRY_FILES = (
    MARKER, ".lock", "sessions", "boot", "maintenance.lock", CACHE_SECRET_FILE,
)  # fmt: skip


class CacheDir(DirFD):
    """Paths and housekeeping rules of one cache directory. Every file
    operation goes through the root's descriptor (:class:`DirFD`)."""

    def __init__(
        self,
        root: str,
        access: Access | None = None,
        *,
        lock_timeout_s: float = 30.0,
    ) -> None:
        """Nothing is opened yet: :meth:`open` creates or checks the directory.

        Args:
            access: who may use it (a store's ``cache_group``); None, for the
                tools, takes the one the root was made with.
            lock_timeout_s: how long :meth:`locked` waits for the lock.
        """
        super().__init__(root, access)
        self.lock_timeout_s = lock_timeout_s
        self.index_path = os.path.join(self.root, "index")
        self.tmp_dir = os.path.join(self.root, "tmp")
        self.claims_path = os.path.join(self.root, "claims")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.maintenance_lock = os.path.join(self.root, "maintenance.lock")

    @classmethod
    def for_config(cls, config: StoreConfig) -> CacheDir:
        """The directory a store's config names, with its access
        (``cache_group``) and lock bound (``lock_timeout_s``).

        Raises:
            ConfigError: ``cache_group`` names no group.
        """
        return cls(
            str(config.cache_dir),
            Access.for_config(config.cache_group),
            lock_timeout_s=config.lock_timeout_s,
        )

    def open(self) -> None:
        """Create the directory and marker, or check an existing marker.

        Raises:
            ConfigError: ``root`` is a file, a symlink, writable by every
                user, someone else's, a non-empty directory without a marker
                (refusing protects foreign files from our housekeeping), or
                one of its entries is a symlink or someone else's.
            BadMagic: the marker is not an npukv_store marker.
            VersionMismatch: the marker has another format version.
        """
        self.open_root(create=True)
        self._warn_if_shared()
        if self.lstat(MARKER) is None:
            # a secret placed by an operator before the first open shares
            # another cache's keys (docs/format.md 4.1)
            foreign = sorted(set(self.listdir()) - {"tmp", ".lock", CACHE_SECRET_FILE})
            # another process may have created the marker (and more) meanwhile
            if foreign and self.lstat(MARKER) is None:
                raise ConfigError(
                    f"cache_dir: {self.root} holds {foreign[:3]} but no {MARKER} "
                    "marker; expected an empty directory or an npukv_store cache"
                )
            self.check_entries(ENTRY_DIRS, ENTRY_FILES)
            self._create_marker()
        self.read_marker()
        self.check_entries(ENTRY_DIRS, ENTRY_FILES)
        self.make_dir("tmp")

    def open_existing(self) -> None:
        """Open a cache that must exist already (the tools): root, marker and
        entries checked, nothing created.

        Raises:
            ConfigError: as :meth:`open`, or there is no marker.
            BadMagic, VersionMismatch: as :meth:`open`.
        """
        self.open_root(create=False)
        if self.lstat(MARKER) is None:
            raise ConfigError(
                f"cache_dir: {self.root} has no {MARKER} marker; expected an "
                "npukv cache"
            )
        self.read_marker()
        self.check_entries(ENTRY_DIRS, ENTRY_FILES)

    def _warn_if_shared(self) -> None:
        st = self.root_stat
        if st is not None and self.access.gid is None and st.st_mode & 0o077:
            logger.warning(
                "cache_dir %s has mode %04o: other users may read it (chunk files "
                "give prompts away); expected 0700 (chmod -R go-rwx it), or "
                "cache_group for a deliberate share",
                self.root,
                stat.S_IMODE(st.st_mode),
            )

    def _create_marker(self) -> None:
        body = {
            "magic": MARKER_MAGIC,
            "format_version": FORMAT_VERSION,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "created_by": f"{os.getpid()}@{HOST}",
        }
        self.make_dir("tmp")
        self._publish_once(MARKER, json.dumps(body, indent=1).encode(), "marker")

    def _publish_once(self, name: str, data: bytes, tag: str) -> None:
        """Write ``data`` to tmp/, fsync, and link() it to ``name``: link()
        fails if another process published first, and theirs wins."""
        tmp = self.tmp_path(tag)
        fd = self.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            with contextlib.suppress(FileExistsError):
                self.link(tmp, name)
                self.sync_dir(os.path.dirname(name))  # the name too (0071)
        finally:
            self.unlink_quietly(tmp)

    def read_marker(self) -> dict[str, object]:
        """The parsed marker.

        Raises:
            BadMagic, VersionMismatch: as in :meth:`open`.
            UnsafeEntry: the marker is a symlink or not a regular file.
        """
        marker = self.full(MARKER)
        raw = self.read_bytes(MARKER, limit=1 << 20)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadMagic(
                f"{marker}: not JSON ({exc}); expected an npukv marker"
            ) from None
        if not isinstance(body, dict) or body.get("magic") != MARKER_MAGIC:
            raise BadMagic(f"{marker}: no magic {MARKER_MAGIC!r}; not an npukv cache")
        if body.get("format_version") == 1:
            raise VersionMismatch(
                f"{marker}: format version 1 (unkeyed block keys), expected "
                f"{FORMAT_VERSION}; its keys cannot be rekeyed without the prompts, "
                "so there is no migration: remove the directory (rm -r it) "
                "or point cache_dir elsewhere (docs/decisions/0058)"
            )
        if body.get("format_version") != FORMAT_VERSION:
            raise VersionMismatch(
                f"{marker}: format version {body.get('format_version')!r}, "
                f"expected {FORMAT_VERSION}"
            )
        return body

    def read_bytes(self, path: str, *, limit: int) -> bytes:
        """A small file of the cache (at most ``limit`` bytes), never read
        through a symlink.

        Raises:
            FileNotFoundError: it is missing.
            UnsafeEntry: it is a symlink or not a regular file.
        """
        fd = self.open_file(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            check_entry(self.full(path), st, self.access, directory=False)
            return os.read(fd, limit)
        finally:
            os.close(fd)

    def read_secret(self) -> bytes:
        """The directory's secret (npukv_store.keying), made on first use:
        32 random bytes, published with link() so that concurrent openers
        agree on one."""
        if self.lstat(CACHE_SECRET_FILE) is None:
            self._publish_once(
                CACHE_SECRET_FILE, secrets.token_bytes(SECRET_BYTES), "secret"
            )
        return read_secret_file(
            CACHE_SECRET_FILE, what=f"cache_dir {self.root}", dir_fd=self.fd,
            gid=self.access.gid,
        )  # fmt: skip

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory-wide lock (released by the kernel if we die).

        Raises:
            ConfigError: the lock stayed held for ``lock_timeout_s``; the
                message names its holder where it can.
            UnsafeEntry: ``.lock`` is a symlink or not ours.
        """
        fd = open_lock_file(self, ".lock")
        try:
            wait_for_lock(fd, self.full(".lock"), self.lock_timeout_s)
            # who holds it, for the message of a process that gives up waiting
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}@{HOST}\n".encode(), 0)
            yield
        finally:
            os.close(fd)

    def ns_dir(self, namespace: str) -> str:
        return os.path.join(self.root, namespace)

    def chunk_path(self, namespace: str, chunk_id: int) -> str:
        return os.path.join(
            self.root, namespace, "chunks", f"{chunk_id:016x}.safetensors"
        )

    def tmp_path(self, tag: int | str) -> str:
        """A new in-flight file name: ``<pid>-<hex>.tmp``. Chunks use their id;
        other files get a random suffix so threads of one process never share."""
        if isinstance(tag, int):
            name = f"{tag:016x}"
        else:
            name = tag.encode().hex() + secrets.token_hex(8)
        return os.path.join(self.tmp_dir, f"{os.getpid()}-{name}.tmp")

    def ensure_namespace(self, namespace: str, canonical_json: str) -> None:
        """Create ``<ns>/chunks/`` and ``<ns>/namespace.json`` if missing.

        Raises:
            NamespaceMismatch: namespace.json holds another spec (a fingerprint
                collision or a hand-edited file).
            UnsafeEntry: ``<ns>``, its ``chunks`` or namespace.json is a
                symlink or someone else's.
        """
        self.make_dir(namespace)
        self.make_dir(os.path.join(namespace, "chunks"))
        path = os.path.join(namespace, "namespace.json")
        try:
            found = self.read_bytes(path, limit=1 << 20).decode("utf-8", "replace")
        except FileNotFoundError:
            tmp = self.tmp_path("namespace")
            fd = self.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.write(fd, canonical_json.encode("utf-8"))
                # before the rename: else a power cut can leave the name with
                # no bytes, and every open refuses it (docs/decisions/0071)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.rename(tmp, path)  # same content from every writer: last one wins
            self.sync_dir(namespace)
            return
        if found != canonical_json:
            raise NamespaceMismatch(
                f"{self.full(path)}: holds {found[:120]!r}..., expected the spec "
                f"{canonical_json[:120]!r}..."
            )

    def namespaces(self) -> list[str]:
        """Namespace directories present on disk (a symlink or another kind
        of file with a namespace's name is skipped, never followed)."""
        found = []
        with self.subdir() as fd, os.scandir(fd) as entries:
            for entry in entries:
                if not _NS_RE.match(entry.name):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    found.append(entry.name)
                else:
                    logger.warning(
                        "skipping %s: not a directory (never followed)",
                        self.full(entry.name),
                    )
        return sorted(found)

    def chunk_files(self, namespace: str) -> dict[int, str]:
        """chunk id -> path of every chunk file of ``namespace`` (a
        ``<ns>/chunks`` that is a symlink or someone else's: none, with a
        warning; a chunk name that is a symlink is listed, and fails to open
        as a chunk, so it is removed as garbage)."""
        try:
            names = self.listdir(os.path.join(namespace, "chunks"))
        except UnsafeEntry as exc:
            logger.warning("skipping namespace %s: %s", namespace, exc)
            return {}
        chunks = os.path.join(self.root, namespace, "chunks")
        found = {}
        for name in names:
            match = _CHUNK_RE.match(name)
            if match:
                found[int(match.group(1), 16)] = os.path.join(chunks, name)
        return found

    def garbage_tmp(self, max_age_s: float) -> list[str]:
        """tmp/ files whose writer is dead, or older than ``max_age_s``, and
        anything there that is not a regular file of ours (removing a symlink
        removes the link, not its target)."""
        now = time.time()
        garbage = []
        with contextlib.suppress(FileNotFoundError), self.subdir("tmp") as fd:
            for name in os.listdir(fd):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # finished or removed meanwhile
                match = _TMP_RE.match(name)
                if (
                    match is None
                    or not stat.S_ISREG(st.st_mode)
                    or now - st.st_mtime > max_age_s
                    or not pid_alive(safe_pid(match.group(1)) or 0)
                ):
                    garbage.append(os.path.join(self.tmp_dir, name))
        return garbage

    def file_age_s(self, path: str) -> float:
        """Seconds since the cache's file ``path`` was last written (0 when
        it vanished)."""
        st = self.lstat(path)
        return 0.0 if st is None else time.time() - st.st_mtime


def creator_alive(creator: str) -> bool:
    """Whether the ``pid@host`` that wrote a chunk may still be publishing it."""
    pid, _, host = creator.partition("@")
    if host != HOST:
        return False  # another host cannot hold our publish window open
    alive = safe_pid(pid)
    return alive is not None and pid_alive(alive)
