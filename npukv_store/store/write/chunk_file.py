"""Writing one chunk file and moving it into place.

Runs in: any process that puts; no shared state, thread-safe.

    write_chunk()   - tmp/ write (layer by layer), fsync, rename into <ns>/chunks/
    publish_image() - the same for a chunk image already in memory (the ring)

The file only appears under ``chunks/`` by ``rename()`` once complete (and
fsynced with ``fsync=chunk``), so no reader can ever see a partial chunk. A
failure removes the tmp file and re-raises; a kill leaves it for recovery.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from npukv_store import native
from npukv_store.io.direct import open_direct
from npukv_store.io.engine import IOEngine
from npukv_store.io.writer import write_image
from npukv_store.keying import DEFAULT_TENANT
from npukv_store.spec import NamespaceSpec
from npukv_store.store.directory import HOST, CacheDir
from npukv_store.store.format import encode_header, layer_checksums

_IOV_MAX = 1024
#: Where a directory fd can be named as a path (Linux); without it, the
#: background writer's O_DIRECT writes become buffered ones.
_PROC_FD = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else ""


def write_chunk(
    cdir: CacheDir,
    spec: NamespaceSpec,
    namespace: str,
    chunk_id: int,
    keys: Sequence[bytes],
    rows: Mapping[str, np.ndarray],
    *,
    created_ns: int,
    sync: bool,
    tenant: bytes = DEFAULT_TENANT,
) -> tuple[str, int]:
    """Write a chunk of ``keys`` and move its file into place (no index rows yet).

    Args:
        namespace: the namespace's hex fingerprint (its directory name).
        rows: tensor name -> ``uint8 [len(keys), row_bytes]`` rows.
        sync: fsync the file before the rename and the directory after it.

    Returns:
        The chunk's final path and its size in bytes.

    Raises:
        OSError: the write failed; nothing was moved into place.
    """
    header = encode_header(
        spec, namespace, keys, creator=f"{os.getpid()}@{HOST}",
        created_ns=created_ns, tenant=tenant,
    )  # fmt: skip
    return _publish_file(
        cdir,
        namespace,
        chunk_id,
        lambda fd, _direct: _write_layers(fd, spec, header, rows, len(keys), sync),
        sync=sync,
        direct=False,
    )


def publish_image(
    cdir: CacheDir,
    namespace: str,
    chunk_id: int,
    image: np.ndarray,
    engine: IOEngine,
    *,
    sync: bool,
    padded: np.ndarray | None = None,
    tail_offset: int | None = None,
    fill_tail: Callable[[], None] | None = None,
) -> tuple[str, int]:
    """Write a complete chunk image (header, data, checksums) from memory through
    ``engine`` and move it into place (no index rows yet): the background
    writer's path, with a few large requests straight from the staging ring.

    Args:
        padded: the image followed by zero or more bytes up to a multiple of
            4096, in page-aligned memory: given, the file is written with
            O_DIRECT (``direct_io``) and truncated to the image's size.
        tail_offset, fill_tail: see :func:`~npukv_store.io.writer.write_image`.

    Returns:
        The chunk's final path and its size in bytes.
    """

    def write(fd: int, direct: bool) -> int:
        if direct and padded is not None:
            # Sized before the first write: writes inside i_size run side by
            # side, where ext4 serialises (and io_uring punts) each extending
            # O_DIRECT write: 1.16 against 1.03 GB/s at queue depth 16
            # (docs/decisions/0021). Buffered writes gained nothing measurable.
            os.ftruncate(fd, padded.nbytes)
            write_image(
                engine, fd, padded, tail_offset=tail_offset, fill_tail=fill_tail
            )
            os.ftruncate(fd, image.nbytes)  # drop the alignment padding
        else:
            write_image(
                engine, fd, image, writeback=sync, tail_offset=tail_offset,
                fill_tail=fill_tail,
            )  # fmt: skip
        return int(image.nbytes)

    return _publish_file(
        cdir, namespace, chunk_id, write, sync=sync, direct=padded is not None
    )


def _publish_file(
    cdir: CacheDir,
    namespace: str,
    chunk_id: int,
    write: Callable[[int, bool], int],
    *,
    sync: bool,
    direct: bool,
) -> tuple[str, int]:
    """The publish order for one file: ``write(fd, is_direct)`` into a new tmp/
    file, fsync (``sync``), rename into ``chunks/``, fsync the directory.
    Every step is relative to the root's fd (a symlinked ``tmp`` or
    ``chunks`` is refused, never followed) and the file gets the access's
    mode (0600, or 0660 with cache_group)."""
    path = cdir.chunk_path(namespace, chunk_id)
    tmp = cdir.tmp_path(chunk_id)
    fd, is_direct = _create_tmp(cdir, tmp, direct)
    try:
        size = write(fd, is_direct)
        if sync:
            os.fsync(fd)
        cdir.rename(tmp, path)
    except BaseException:
        # the first error is the one to report, not a failed cleanup's
        with contextlib.suppress(OSError):
            cdir.unlink_quietly(tmp)
        raise
    finally:
        os.close(fd)
    if sync:
        with cdir.subdir(os.path.dirname(path)) as dir_fd:
            os.fsync(dir_fd)
    return path, size


def _create_tmp(cdir: CacheDir, tmp: str, direct: bool) -> tuple[int, bool]:
    """A new tmp/ file, with O_DIRECT when ``direct`` and the filesystem
    allows it. open_direct() takes a path: it is given the tmp directory's
    fd as /proc/self/fd/N/<name>, so the open stays relative to a directory
    we checked (the magic link is the directory itself, not a lookup of
    ``tmp`` by name)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if not (direct and _PROC_FD):
        return cdir.open_file(tmp, flags), False
    mode = cdir.access.file_mode
    with cdir.parent(tmp) as (dir_fd, name):
        fd, is_direct = open_direct(
            f"{_PROC_FD}/{dir_fd}/{name}", flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode
        )
    try:
        cdir.access.fix_mode(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, is_direct


def _write_layers(
    fd: int,
    spec: NamespaceSpec,
    header: bytes,
    rows: Mapping[str, np.ndarray],
    num_blocks: int,
    sync: bool,
) -> int:
    """Write header, layers and checksum table; returns the file size.

    Layer by layer: hash a layer, write it and (with ``sync``) start its writeback
    at once, so the disk writes layer l while Python hashes layer l+1 and the final
    fsync has little left (docs/RESULTS.md measures the gain).
    """
    offset = _write_all(fd, [memoryview(header)])
    sums = np.empty((num_blocks, len(spec.layers)), dtype="<u8")
    for col, layer in enumerate(spec.layers):
        views = [
            np.ascontiguousarray(rows[name]).data.cast("B")
            for name in layer.tensor_names()
        ]
        sums[:, col] = layer_checksums(views, num_blocks)
        written = _write_all(fd, views)
        if sync:
            native.sync_file_range_write(fd, offset, written)
        offset += written
    return offset + _write_all(fd, [sums.data.cast("B")])


def _write_all(fd: int, buffers: list[memoryview]) -> int:
    total = 0
    pending = [b for b in buffers if len(b)]
    while pending:
        done = os.writev(fd, pending[:_IOV_MAX])
        total += done
        # short writes are legal: drop what was written, resume mid-buffer
        while done:
            if done >= len(pending[0]):
                done -= len(pending.pop(0))
            else:
                pending[0] = pending[0][done:]
                done = 0
    return total
