"""The cache directory: its marker, paths, open-time lock and garbage rules.

Runs in: any process opening a store, and the maintenance job.

    CacheDir.open()      - create or validate the NPUKV_STORE marker
    CacheDir.locked()    - the directory-wide flock held while recovering
    CacheDir.tmp_path()  - a fresh in-flight file name that carries its pid
    is_garbage_tmp()     - a tmp/ file whose writer is dead or that is too old
    is_orphan_chunk()    - a chunk file no index row points to and no live
                           publisher can still commit
    unlink_quietly()     - remove a file; already gone is the same outcome

Layout (docs/format.md)::

    <cache_dir>/NPUKV_STORE               marker: {"magic", "format_version", ...}
    <cache_dir>/index/                    the LMDB index
    <cache_dir>/claims/                   save claims (LMDB, never fsynced)
    <cache_dir>/quarantine/               corrupt chunks, kept for inspection
    <cache_dir>/maintenance.lock          flock: one maintenance run at a time
    <cache_dir>/<ns>/namespace.json       the namespace spec, human-readable
    <cache_dir>/<ns>/chunks/<id>.safetensors
    <cache_dir>/tmp/<pid>-<id>.tmp        in-flight files
    <cache_dir>/.lock                     flock: recovery and index rebuilds
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator

from npukv_store.errors import (
    BadMagic,
    ConfigError,
    NamespaceMismatch,
    VersionMismatch,
)
from npukv_store.liveness import pid_alive
from npukv_store.spec import FORMAT_VERSION

MARKER = "NPUKV_STORE"
MARKER_MAGIC = "npukv_store"
HOST = socket.gethostname()
_TMP_RE = re.compile(r"^(\d+)-[0-9a-f]+\.tmp$")
_CHUNK_RE = re.compile(r"^([0-9a-f]{16})\.safetensors$")
_NS_RE = re.compile(r"^[0-9a-f]{32}$")


class CacheDir:
    """Paths and housekeeping rules of one cache directory."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.index_path = os.path.join(self.root, "index")
        self.tmp_dir = os.path.join(self.root, "tmp")
        self.claims_path = os.path.join(self.root, "claims")
        self.quarantine_dir = os.path.join(self.root, "quarantine")
        self.maintenance_lock = os.path.join(self.root, "maintenance.lock")

    def open(self) -> None:
        """Create the directory and marker, or check an existing marker.

        Raises:
            ConfigError: ``root`` is a file, or a non-empty directory without a
                marker (refusing protects foreign files from our housekeeping).
            BadMagic: the marker is not an npukv_store marker.
            VersionMismatch: the marker has another format version.
        """
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError(f"cache_dir: {self.root} is a file, expected a directory")
        os.makedirs(self.root, exist_ok=True)
        marker = os.path.join(self.root, MARKER)
        if not os.path.exists(marker):
            foreign = sorted(set(os.listdir(self.root)) - {"tmp", ".lock"})
            # another process may have created the marker (and more) meanwhile
            if foreign and not os.path.exists(marker):
                raise ConfigError(
                    f"cache_dir: {self.root} holds {foreign[:3]} but no {MARKER} "
                    "marker; expected an empty directory or an npukv_store cache"
                )
            self._create_marker(marker)
        self.read_marker()
        os.makedirs(self.tmp_dir, exist_ok=True)

    def _create_marker(self, marker: str) -> None:
        body = {
            "magic": MARKER_MAGIC,
            "format_version": FORMAT_VERSION,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "created_by": f"{os.getpid()}@{HOST}",
        }
        os.makedirs(self.tmp_dir, exist_ok=True)
        tmp = self.tmp_path("marker")
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(body, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        # link() fails if another process created the marker first: theirs wins.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, marker)
        os.unlink(tmp)

    def read_marker(self) -> dict[str, object]:
        """The parsed marker.

        Raises:
            BadMagic, VersionMismatch: as in :meth:`open`.
        """
        marker = os.path.join(self.root, MARKER)
        try:
            with open(marker, encoding="utf-8") as handle:
                body = json.load(handle)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadMagic(
                f"{marker}: not JSON ({exc}); expected an npukv marker"
            ) from None
        if not isinstance(body, dict) or body.get("magic") != MARKER_MAGIC:
            raise BadMagic(f"{marker}: no magic {MARKER_MAGIC!r}; not an npukv cache")
        if body.get("format_version") != FORMAT_VERSION:
            raise VersionMismatch(
                f"{marker}: format version {body.get('format_version')!r}, "
                f"expected {FORMAT_VERSION}"
            )
        return body

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory-wide lock (released by the kernel if we die)."""
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
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
        """
        os.makedirs(os.path.join(self.ns_dir(namespace), "chunks"), exist_ok=True)
        path = os.path.join(self.ns_dir(namespace), "namespace.json")
        try:
            with open(path, encoding="utf-8") as handle:
                found = handle.read()
        except FileNotFoundError:
            tmp = self.tmp_path("namespace")
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(canonical_json)
            os.replace(tmp, path)  # same content from every writer: last one wins
            return
        if found != canonical_json:
            raise NamespaceMismatch(
                f"{path}: holds {found[:120]!r}..., expected the spec "
                f"{canonical_json[:120]!r}..."
            )

    def namespaces(self) -> list[str]:
        """Namespace directories present on disk."""
        return sorted(n for n in os.listdir(self.root) if _NS_RE.match(n))

    def chunk_files(self, namespace: str) -> dict[int, str]:
        """chunk id -> path of every chunk file of ``namespace``."""
        chunks = os.path.join(self.root, namespace, "chunks")
        try:
            names = os.listdir(chunks)
        except FileNotFoundError:
            return {}
        found = {}
        for name in names:
            match = _CHUNK_RE.match(name)
            if match:
                found[int(match.group(1), 16)] = os.path.join(chunks, name)
        return found

    def garbage_tmp(self, max_age_s: float) -> list[str]:
        """tmp/ files whose writer is dead, or older than ``max_age_s``."""
        try:
            names = os.listdir(self.tmp_dir)
        except FileNotFoundError:
            return []
        now = time.time()
        garbage = []
        for name in names:
            path = os.path.join(self.tmp_dir, name)
            match = _TMP_RE.match(name)
            try:
                age = now - os.stat(path).st_mtime
            except FileNotFoundError:
                continue  # finished or removed meanwhile
            if match is None or not pid_alive(int(match.group(1))) or age > max_age_s:
                garbage.append(path)
        return garbage


def creator_alive(creator: str) -> bool:
    """Whether the ``pid@host`` that wrote a chunk may still be publishing it."""
    pid, _, host = creator.partition("@")
    if host != HOST or not pid.isdigit():
        return False  # another host cannot hold our publish window open
    return pid_alive(int(pid))


def file_age_s(path: str) -> float:
    """Seconds since ``path`` was last written (0 when it vanished)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def unlink_quietly(path: str) -> None:
    """Remove ``path``; already gone is the same outcome."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
