"""What the fault suite (tests/faults) shares: stores filled with known
blocks, chunk files found by the put that wrote them, page-cache control, bit
flips, mounts and child processes.

Block bytes are a pure function of the key (tests/support/blocks.py), so any
process can tell right bytes from wrong ones.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.testing import faults as io_faults
from tests.support.blocks import block_tensors, tiny_spec
from tests.support.chunks import chunk_files
from tests.support.scenarios.oracles import SPEC

#: Rows of 8 KiB per part: a chunk of 8 blocks is 384 KiB, so most of its data
#: lies past the header read (64 KiB) and, with the page cache dropped, is
#: read through the I/O engine, where NPUKV_FAULTS acts.
BIG = tiny_spec(block_size=SPEC.block_size, row_shape=(16, 4, 64))
SMALL = SPEC  # the scenarios' namespace
BLOCKS = 8  # per chunk


def keys_for(tag: str, count: int) -> list[bytes]:
    return [
        hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest()
        for i in range(count)
    ]


def config(cache_dir: str | Path, **kw: Any) -> StoreConfig:
    values: dict[str, Any] = {
        "cache_dir": str(cache_dir), "capacity": "1GiB", "ring_size": "4MiB",
    }  # fmt: skip
    values.update(kw)
    return StoreConfig(**values)


def chunk_paths(cache_dir: str | Path) -> set[str]:
    return set(chunk_files(str(cache_dir)).values())


def put_chunk(store: KVStore, keys: list[bytes]) -> str:
    """put() ``keys`` as one new chunk; returns its file (found by the listing
    before and after: no internal API)."""
    before = chunk_paths(store.config.cache_dir)
    result = store.put(keys, block_tensors(store.spec, keys))
    assert result.stored == len(keys), result
    (path,) = chunk_paths(store.config.cache_dir) - before
    return path


def fill(store: KVStore, tag: str, chunks: int = 3) -> list[tuple[str, list[bytes]]]:
    """``chunks`` chunks of BLOCKS blocks each: ``[(path, keys)]``."""
    out = []
    for c in range(chunks):
        keys = keys_for(f"{tag}:{c}", BLOCKS)
        out.append((put_chunk(store, keys), keys))
    return out


def drop_page_cache(paths: Any) -> None:
    """Evict the (clean, fsynced) pages of ``paths``: the next read goes to the
    disk through the I/O engine instead of the cached-layer path."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def data_start(path: str) -> int:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
    return 8 + length


def table_offset(path: str, spec: Any, blocks: int) -> int:
    return data_start(path) + blocks * spec.block_bytes


def block_at(spec: Any, blocks: int, rel: int) -> int:
    """The block (row) whose bytes sit at offset ``rel`` of the data section
    (layer-major: each layer's parts one after another, ``blocks`` rows each)."""
    for layer in spec.layers:
        for part in layer.parts:
            span = blocks * part.row_bytes
            if rel < span:
                return rel // part.row_bytes
            rel -= span
    raise ValueError("offset past the data section")


def flip_bit(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ (1 << bit)]))


def fresh_config(cfg: StoreConfig, **kw: Any) -> StoreConfig:
    values = {k: getattr(cfg, k) for k in StoreConfig.keys()}  # noqa: SIM118 - a classmethod
    values.update(kw)
    return StoreConfig(**values)


# -- mounts (root only) ----------------------------------------------------------


def _mount(*args: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a real tmpfs / read-only mount")
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} refused: {done.stderr.strip()}")


def _umount(path: str) -> None:
    subprocess.run(["umount", "-l", path], capture_output=True, check=False)


@contextlib.contextmanager
def tmpfs(path: str | Path, size: str = "8m") -> Iterator[str]:
    """A real size-limited tmpfs mounted at ``path`` for the block."""
    os.makedirs(path, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield str(path)
    finally:
        _umount(str(path))


@contextlib.contextmanager
def read_only(path: str | Path) -> Iterator[str]:
    """``path`` (a directory) made read-only by a read-only bind mount over
    itself: it holds for root too, where chmod does not."""
    _mount("--bind", str(path), str(path))
    try:
        done = subprocess.run(
            ["mount", "-o", "remount,ro,bind", str(path)], capture_output=True,
            text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"read-only remount refused: {done.stderr.strip()}")
        yield str(path)
    finally:
        _umount(str(path))


def fill_disk(directory: str, leave: int = 0) -> str:
    """A file taking all but ``leave`` bytes of ``directory``'s filesystem."""
    path = os.path.join(directory, "filler")
    with open(path, "wb") as handle:
        chunk = b"\0" * (1 << 16)
        while True:
            free = shutil.disk_usage(directory).free - leave
            if free <= 0:
                break
            try:
                handle.write(chunk[: min(len(chunk), free)])
                handle.flush()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    return path


# -- child processes --------------------------------------------------------------


def run_child(code: str, *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter at the repository root."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("NPUKV_FAULTS", None)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
        text=True, timeout=timeout, check=False,
    )  # fmt: skip


def start_child(code: str, *, keep_faults: bool = False) -> subprocess.Popen[str]:
    """Start ``code`` in a fresh interpreter; its stdout and stderr together
    on ``.stdout`` (text). NPUKV_FAULTS reaches it only with ``keep_faults``."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root)
    if not keep_faults:
        env.pop("NPUKV_FAULTS", None)
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


class WriteGate:
    """Holds the engine writes of this process's stores while it is shut:
    a write that NPUKV_FAULTS' ``slow`` rule fires on (set one, e.g.
    ``write:slow:ms=0``, before the store opens) waits until :meth:`open`,
    or ``deadline_s`` (a deadline to fail by). ``held``: writes waiting now;
    ``threads``: the thread of each write held; ``expired``: writes that
    waited out the deadline (someone waited for a write while it was shut)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, deadline_s: float = 20.0):
        self.deadline_s = deadline_s
        self.held = 0
        self.expired = 0
        self.threads: list[str] = []
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        fires = io_faults.FaultRule.fires

        def gated(rule: io_faults.FaultRule, request: Any) -> bool:
            hit = fires(rule, request)
            if hit and rule.kind == "slow" and not self._open.is_set():
                self._hold()
            return hit

        monkeypatch.setattr(io_faults.FaultRule, "fires", gated)

    def _hold(self) -> None:
        with self._lock:
            self.held += 1
            self.threads.append(threading.current_thread().name)
        try:
            if not self._open.wait(self.deadline_s):
                with self._lock:
                    self.expired += 1
        finally:
            with self._lock:
                self.held -= 1

    def shut(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()
