"""The pure-Python twin of the C extension ``npukv_store._native``.

Runs in: a process started with ``NPUKV_NATIVE=0``, where npukv_store.native
binds these functions at import in place of the C ones; tests import it to run
the same cases against both. It has the C module's calling convention
(``_native.pyi``: positional arguments, ``bytes`` results) and checks its
arguments in the C code's order with the same messages, so npukv_store.native
wraps either one the same way. No twin for device.c's CUDA/ACL calls.

    sync_file_range()   - libc's, through ctypes (a no-op where libc lacks it)
    page_residency()    - mincore over a private read-only mapping
    cached_pages()      - page_residency over the ranges' span
    xxh3_rows()         - python-xxhash, one row at a time
    pread_rows_xxh3()   - os.preadv of each row, then xxh3_rows
    pread_layers_xxh3() - pread_rows_xxh3 per layer
    copy_runs()         - one numpy assignment per run
    copy_ptrs()         - one ctypes.memmove per run
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

#: anything with the buffer protocol (npukv_store.native exports the same alias)
BufferLike = Any

SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h
#: native/checksum.c's NKV_STREAM_MIN_BYTES; the twin never bounces
BOUNCE_ABOVE_BYTES = 256 * 1024
_COPY_MAX_THREADS = 64  # native/copy.c NKV_COPY_MAX_THREADS
_MAX_PARTS = 64  # native/checksum.c NKV_MAX_PARTS
#: native/checksum.c NKV_MAX_ROWS: rows (times layers) one hashing call takes
_MAX_ROWS = sys.maxsize // 1024
#: native/nkv.h NKV_MAX_RUNS: runs one copy_runs or copy_ptrs call takes
_MAX_RUNS = sys.maxsize // 64
#: C's LLONG_MAX (INT64_MAX): no file offset or address range may end past it
_INT64_MAX = 2**63 - 1
_NATIVE_ORDER = "<" if sys.byteorder == "little" else ">"


def _libc_fn(name: str, argtypes: list[Any]) -> Any:
    """libc's ``name`` with errno kept, or None where libc lacks it (not Linux)."""
    libc_name = ctypes.util.find_library("c")
    fn = (
        getattr(ctypes.CDLL(libc_name, use_errno=True), name, None)
        if libc_name
        else None
    )
    if fn is not None:
        fn.argtypes = argtypes
    return fn


_sync_file_range = _libc_fn(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
_mincore = _libc_fn("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])


def sync_file_range(
    fd: int, offset: int, nbytes: int, flags: int = SYNC_FILE_RANGE_WRITE, /
) -> None:
    if offset < 0 or nbytes < 0:
        raise ValueError("sync_file_range: offset and nbytes must be >= 0")
    if _sync_file_range is None:
        return  # not Linux: writeback simply starts at fsync
    if _sync_file_range(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def page_residency(fd: int, offset: int, nbytes: int, /) -> bytes:
    """native/fileio.c's mincore over a private read-only mapping (a copy
    mapping, so ctypes can take its address; unwritten pages stay the file's)."""
    if offset < 0 or nbytes < 0 or offset > _INT64_MAX - nbytes:
        raise ValueError(
            f"page_residency: found offset {offset} and nbytes {nbytes}, "
            f"expected both >= 0 and offset + nbytes <= {_INT64_MAX}"
        )
    start = offset - offset % mmap.PAGESIZE
    span = offset + nbytes - start
    pages = -(-span // mmap.PAGESIZE)
    if pages == 0:
        return b""
    if _mincore is None:
        raise OSError(errno.ENOSYS, "page_residency: no mincore in libc")
    vec = ctypes.create_string_buffer(pages)
    try:
        # Python's mmap refuses a range past the end of the file (C's does
        # not, and mincore reports those pages as absent): map what exists
        span = min(span, os.fstat(fd).st_size - start)
        if span <= 0:
            return bytes(pages)
        mapping = mmap.mmap(fd, span, access=mmap.ACCESS_COPY, offset=start)
    except OSError as exc:
        raise OSError(exc.errno, f"page_residency (mmap/mincore): {exc}") from exc
    with mapping:
        anchor = ctypes.c_char.from_buffer(mapping)
        try:
            if _mincore(ctypes.addressof(anchor), span, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"page_residency (mincore): {os.strerror(err)}")
        finally:
            del anchor  # the mapping cannot close while a ctypes view holds it
    resident = bytes(b & 1 for b in vec.raw[: -(-span // mmap.PAGESIZE)])
    return resident.ljust(pages, b"\0")


def cached_pages(fd: int, ranges: BufferLike, /) -> bytes:
    """native/fileio.c's checks, then one page_residency over the span of the
    non-empty ranges; native-endian uint64 counts."""
    raw = np.frombuffer(ranges, dtype=np.uint8)
    if raw.size % 16:
        raise ValueError(
            f"cached_pages: ranges has {raw.size} bytes, expected int64 "
            "(offset, nbytes) pairs (a multiple of 16)"
        )
    pairs = raw.view(np.int64).reshape(-1, 2)
    # offset + nbytes past INT64_MAX, found without an int64 sum that wraps
    room = _INT64_MAX - np.maximum(pairs[:, 1], 0)
    bad = np.nonzero((pairs < 0).any(axis=1) | (pairs[:, 0] > room))[0]
    if len(bad):
        offset, nbytes = pairs[bad[0]].tolist()
        raise ValueError(
            f"cached_pages: range {bad[0]} has offset {offset} and nbytes "
            f"{nbytes}, expected both >= 0 and offset + nbytes <= {_INT64_MAX}"
        )
    counts = np.zeros(len(pairs), dtype=np.uint64)
    used = pairs[:, 1] > 0
    if used.any():
        page = mmap.PAGESIZE
        start = int(pairs[used, 0].min()) // page * page
        end = int((pairs[used, 0] + pairs[used, 1]).max())
        resident = np.frombuffer(page_residency(fd, start, end - start), np.uint8)
        totals = np.concatenate(([0], np.cumsum(resident, dtype=np.int64)))
        lo = (pairs[used, 0] - start) // page
        hi = (pairs[used, 0] + pairs[used, 1] - 1 - start) // page + 1
        counts[used] = totals[hi] - totals[lo]
    return counts.tobytes()


def _check_parts(fn: str, nparts: int, nrows: int) -> None:
    """native/checksum.c's nkv_parts_seq: 1.._MAX_PARTS parts, 1.._MAX_ROWS
    rows (an empty part passes the multiple-of-nrows check with any nrows)."""
    if not 1 <= nparts <= _MAX_PARTS or not 1 <= nrows <= _MAX_ROWS:
        raise ValueError(
            f"{fn}: found {nparts} parts and {nrows} rows, expected "
            f"1..{_MAX_PARTS} parts and 1..{_MAX_ROWS} rows"
        )


def xxh3_rows(parts: Sequence[BufferLike], nrows: int, /) -> bytes:
    _check_parts("xxh3_rows", len(parts), nrows)
    views = [memoryview(part).cast("B") for part in parts]
    for index, view in enumerate(views):
        if len(view) % nrows:
            raise ValueError(
                f"xxh3_rows: part {index} has {len(view)} bytes, expected a "
                f"multiple of {nrows} rows"
            )
    sizes = [len(view) // nrows for view in views]
    sums = np.empty(nrows, dtype="<u8")
    for row in range(nrows):
        digest = xxhash.xxh3_64()
        for view, size in zip(views, sizes, strict=True):
            digest.update(view[row * size : (row + 1) * size])
        sums[row] = digest.intdigest()
    return sums.tobytes()


def pread_rows_xxh3(fd: int, parts: Sequence[tuple[Any, ...]], nrows: int, /) -> bytes:
    """Each ``(offset, buffer[, reversed])`` part read row by row into place,
    then xxh3_rows over the rows in file order."""
    return _pread_layers("pread_rows_xxh3", fd, [parts], nrows)


def pread_layers_xxh3(
    fd: int, layers: Sequence[Sequence[tuple[Any, ...]]], nrows: int, /
) -> bytes:
    return _pread_layers("pread_layers_xxh3", fd, layers, nrows)


def _pread_layers(
    fn: str, fd: int, layers: Sequence[Sequence[tuple[Any, ...]]], nrows: int
) -> bytes:
    """native/checksum.c's nkv_pread_layers: every layer and part checked (in
    its order, with its messages) before the first read, then each layer's
    parts read and hashed."""
    if not layers or nrows < 1 or nrows > _MAX_ROWS // len(layers):
        raise ValueError(
            f"{fn}: found {len(layers)} layers and {nrows} rows, expected >= 1 of "
            f"each and layers * rows <= {_MAX_ROWS}"
        )
    checked: list[list[tuple[int, memoryview, bool]]] = []
    for layer, parts in enumerate(layers):
        _check_parts(fn, len(parts), nrows)
        checked.append([])
        for index, (offset, buffer, *flag) in enumerate(parts):
            view = memoryview(buffer).cast("B")
            if offset < 0 or offset > _INT64_MAX - len(view) or len(view) % nrows:
                raise ValueError(
                    f"{fn}: layer {layer} part {index} has offset {offset} and "
                    f"{len(view)} bytes, expected offset >= 0, offset + bytes <= "
                    f"{_INT64_MAX} and a multiple of {nrows} rows"
                )
            checked[-1].append((offset, view, bool(flag and flag[0])))
    return b"".join(_pread_layer(fd, parts, nrows) for parts in checked)


def _pread_layer(
    fd: int, parts: list[tuple[int, memoryview, bool]], nrows: int
) -> bytes:
    in_file_order = []
    for offset, view, reversed_ in parts:
        rows = np.frombuffer(view, np.uint8).reshape(nrows, -1)
        order = range(nrows)[::-1] if reversed_ else range(nrows)
        for j, row in enumerate(order):
            _pread_full(fd, rows[row].data, offset + j * rows.shape[1])
        in_file_order.append(rows[list(order)])
    return xxh3_rows(in_file_order, nrows)


def _pread_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, "pread_rows_xxh3 (short read or I/O error)")
        done += got


def _check_threads(fn: str, threads: int) -> None:
    if not 0 <= threads <= _COPY_MAX_THREADS:
        raise ValueError(
            f"{fn}: threads is {threads}, expected 0 (default) to {_COPY_MAX_THREADS}"
        )


def _int64_code(view: memoryview) -> str:
    """The struct code of ``view``'s items, a native byte-order prefix dropped."""
    fmt = view.format
    return fmt[1:] if fmt[:1] in ("@", "=", _NATIVE_ORDER) else fmt


def copy_runs(
    srcs: Sequence[BufferLike],
    dsts: Sequence[BufferLike],
    runs: BufferLike,
    /,
    threads: int = 0,
) -> int:
    """native/copy.c's checks in its order, then one numpy assignment per run
    (numpy copies through a temporary where ranges overlap: memmove). Runs on
    the calling thread whatever ``threads`` says."""
    _check_threads("copy_runs", threads)
    rows = _run_rows(runs)
    src_items, dst_items = _sequence(srcs, "srcs"), _sequence(dsts, "dsts")
    sides = (_byte_arrays(src_items, "src"), _byte_arrays(dst_items, "dst"))
    total = 0
    for index, row in enumerate(rows):
        _check_run(index, row, sides)
        total += row[4]
        if total > sys.maxsize:
            raise ValueError(
                f"copy_runs: the runs' nbytes add up to more than {sys.maxsize}, "
                "expected at most that"
            )
    for src_idx, src_off, dst_idx, dst_off, nbytes in rows:
        if nbytes > 0:
            src = sides[0][src_idx][src_off : src_off + nbytes]
            sides[1][dst_idx][dst_off : dst_off + nbytes] = src
    return total


def _run_rows(runs: BufferLike) -> list[list[int]]:
    """``runs`` as rows of 5 ints, checked as native/copy.c checks it."""
    view = memoryview(runs)
    if view.itemsize != 8 or _int64_code(view) not in ("q", "l"):
        raise ValueError(
            f"copy_runs: runs has format '{view.format}' and itemsize "
            f"{view.itemsize}, expected native int64 ('q' or 'l', itemsize 8)"
        )
    if view.ndim != 2:
        raise ValueError(
            f"copy_runs: runs has {view.ndim} dimensions, expected shape [k, 5]"
        )
    assert view.shape is not None  # ndim 2
    if view.shape[1] != 5:
        raise ValueError(
            f"copy_runs: runs has {view.shape[1]} columns, expected shape [k, 5]"
        )
    if not view.c_contiguous:
        raise ValueError(
            "copy_runs: runs is not C-contiguous, expected a C-contiguous [k, 5] "
            "int64 array"
        )
    if view.shape[0] > _MAX_RUNS:  # the exporter's word (as_strided claims any)
        raise ValueError(
            f"copy_runs: runs has {view.shape[0]} rows, expected 0..{_MAX_RUNS}"
        )
    # memoryview refuses to cast a view with a 0 in its shape
    flat: list[int] = view.cast("B").cast("q").tolist() if view.nbytes else []
    return [flat[i : i + 5] for i in range(0, len(flat), 5)]


def _sequence(items: Sequence[BufferLike], name: str) -> list[BufferLike]:
    try:
        return list(items)
    except TypeError:
        raise TypeError(f"copy_runs: {name} must be a sequence") from None


def _byte_arrays(items: list[BufferLike], what: str) -> list[np.ndarray]:
    """uint8 views, taken as the C side takes them: np.frombuffer asks for
    PyBUF_WRITABLE, then PyBUF_SIMPLE (C-contiguous) as native/copy.c does."""
    expected = "writable C-contiguous" if what == "dst" else "C-contiguous"
    arrays = []
    for index, item in enumerate(items):
        try:
            array = np.frombuffer(item, dtype=np.uint8)
        except (BufferError, ValueError) as err:
            raise ValueError(
                f"copy_runs: {what} {index} is not a {expected} buffer"
            ) from err
        if what == "dst" and not array.flags.writeable:
            raise ValueError(f"copy_runs: {what} {index} is not a {expected} buffer")
        arrays.append(array)
    return arrays


def _check_run(
    index: int, row: list[int], sides: tuple[list[np.ndarray], list[np.ndarray]]
) -> None:
    nbytes = row[4]
    if nbytes < 0:
        raise ValueError(f"copy_runs: run {index} has nbytes {nbytes}, expected >= 0")
    for side, what in enumerate(("src", "dst")):
        buf_idx = row[2 * side]
        if not 0 <= buf_idx < len(sides[side]):
            raise ValueError(
                f"copy_runs: run {index} has {what}_index {buf_idx}, expected 0 <= "
                f"{what}_index < {len(sides[side])}"
            )
    for side, what in enumerate(("src", "dst")):
        buf_idx, offset = row[2 * side], row[2 * side + 1]
        size = len(sides[side][buf_idx])
        if offset < 0 or offset > size or nbytes > size - offset:
            raise ValueError(
                f"copy_runs: run {index} has {what} {buf_idx} offset {offset} + "
                f"nbytes {nbytes}, expected within that {what}'s {size} bytes"
            )


def copy_ptrs(
    src_ptrs: BufferLike,
    dst_ptrs: BufferLike,
    sizes: BufferLike,
    /,
    threads: int = 0,
) -> int:
    """native/ptrs.c's checks, then one ctypes.memmove per run."""
    _check_threads("copy_ptrs", threads)
    total = 0
    for src, dst, size in _ptr_runs("copy_ptrs", (src_ptrs, dst_ptrs, sizes)):
        if size > 0:
            ctypes.memmove(dst, src, size)
            total += size
    return total


def _ptr_runs(fn: str, arrays: tuple[BufferLike, ...]) -> list[tuple[int, int, int]]:
    """``(src, dst, size)`` rows of three int64 arrays, checked as native/ptrs.c
    checks them."""
    names = ("src_ptrs", "dst_ptrs", "sizes")
    views: list[memoryview] = []
    for name, array in zip(names, arrays, strict=True):
        view = memoryview(array)
        if (
            view.itemsize != 8
            or _int64_code(view) not in ("q", "l")
            or view.ndim != 1
            or (not view.c_contiguous)
        ):
            raise ValueError(
                f"{fn}: {name} has format '{view.format}', itemsize {view.itemsize} "
                f"and {view.ndim} dimensions, expected a 1-D C-contiguous native "
                "int64 array"
            )
        views.append(view)
    for name, view in zip(names[1:], views[1:], strict=True):
        if len(view) != len(views[0]):
            raise ValueError(
                f"{fn}: {name} has {len(view)} entries and src_ptrs "
                f"{len(views[0])}, expected equal lengths"
            )
    if len(views[0]) > _MAX_RUNS:  # the exporter's word (as_strided claims any)
        raise ValueError(
            f"{fn}: found {len(views[0])} runs, expected at most {_MAX_RUNS}"
        )
    columns: list[list[int]] = [view.tolist() for view in views]
    total = 0
    for index, (src, dst, size) in enumerate(zip(*columns, strict=True)):
        if size < 0:
            raise ValueError(f"{fn}: run {index} has size {size}, expected >= 0")
        if size > 0 and (src <= 0 or dst <= 0):
            raise ValueError(
                f"{fn}: run {index} has src {src} and dst {dst}, expected non-zero "
                f"addresses (> 0) for a run of {size} bytes"
            )
        if size > 0 and (src > _INT64_MAX - size or dst > _INT64_MAX - size):
            raise ValueError(
                f"{fn}: run {index} has src {src} and dst {dst} + size {size}, "
                f"expected each to end at or below {_INT64_MAX}"
            )
        total += size
        if total > sys.maxsize:
            raise ValueError(
                f"{fn}: the sizes add up to more than {sys.maxsize}, expected at "
                "most that"
            )
    return list(zip(*columns, strict=True))
