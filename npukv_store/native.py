"""The C extension ``npukv_store._native``, or its pure-Python twin.

Runs in: any process. ``NPUKV_NATIVE=0`` selects the twin (the same tests run
against both, as py-lmdb does with ``LMDB_FORCE_CFFI``); so does a missing or
stale build, with one warning.

    sync_file_range_write() - start writeback of a file range, don't wait
    page_residency()        - which pages of a file range the page cache holds
    cached_pages()          - how many pages of each of many ranges it holds
    pread_rows_xxh3()       - read file ranges into buffers and checksum their
                              rows in the same pass (cached chunks)
    pread_layers_xxh3()     - the same for several layers in one call
    xxh3_rows()             - xxh3_64 of each row over several parts (block
                              checksums), without the GIL when native
    copy_runs()             - many byte runs between buffers in one call (ring
                              gathers and scatters), without the GIL when native
    copy_ptrs()             - byte runs between raw addresses (the CPU device
                              backend's copy_runs), without the GIL when native
    cuda_memcpy_batch(), acl_memcpy_batch(), acl_host_register(),
    acl_host_unregister(), cuda_get_last_error()
                            - CUDA / Ascend runtime calls (dlopen) for
                              npukv_store.device; native only: without the
                              extension they raise OSError(ENOSYS)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

#: anything with the buffer protocol (collections.abc.Buffer needs Python 3.12)
BufferLike = Any

ABI_VERSION = 8
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h
_COPY_MAX_THREADS = 64  # native/copy.c NKV_COPY_MAX_THREADS


def _load() -> ModuleType | None:
    if os.environ.get("NPUKV_NATIVE", "1") == "0":
        return None
    try:
        from npukv_store import _native
    except ImportError:
        logger.warning("npukv_store._native is not built; using the Python twin")
        return None
    if _native.ABI_VERSION != ABI_VERSION:
        logger.warning(
            "npukv_store._native has ABI %d, expected %d (stale build); using the "
            "Python twin",
            _native.ABI_VERSION,
            ABI_VERSION,
        )
        return None
    return _native


IMPL = _load()
IS_NATIVE = IMPL is not None


class _Twin:
    """Pure-Python twins of the native entry points."""

    def __init__(self) -> None:
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name, use_errno=True) if libc_name else None
        self._sync_file_range = getattr(libc, "sync_file_range", None)
        if self._sync_file_range is not None:
            self._sync_file_range.argtypes = [
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_uint,
            ]
        self._mincore = getattr(libc, "mincore", None)
        if self._mincore is not None:
            self._mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def sync_file_range(self, fd: int, offset: int, nbytes: int, flags: int) -> None:
        if offset < 0 or nbytes < 0:
            raise ValueError("sync_file_range: offset and nbytes must be >= 0")
        if self._sync_file_range is None:
            return  # not Linux: writeback simply starts at fsync
        if self._sync_file_range(fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sync_file_range: {os.strerror(err)}")

    def page_residency(self, fd: int, offset: int, nbytes: int) -> bytes:
        """native/fileio.c's mincore over a private read-only mapping (a copy
        mapping, so ctypes can take its address; unwritten pages stay the
        file's)."""
        if offset < 0 or nbytes < 0:
            raise ValueError(
                f"page_residency: found offset {offset} and nbytes {nbytes}, "
                "expected both >= 0"
            )
        start = offset - offset % mmap.PAGESIZE
        span = offset + nbytes - start
        pages = -(-span // mmap.PAGESIZE)
        if pages == 0:
            return b""
        if self._mincore is None:
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
                if self._mincore(ctypes.addressof(anchor), span, vec) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"page_residency (mincore): {os.strerror(err)}")
            finally:
                del anchor  # the mapping cannot close while a ctypes view holds it
        return bytes(b & 1 for b in vec.raw[: -(-span // mmap.PAGESIZE)]).ljust(
            pages, b"\0"
        )

    def copy_runs(
        self,
        srcs: Sequence[BufferLike],
        dsts: Sequence[BufferLike],
        runs: BufferLike,
        threads: int,
    ) -> int:
        """native/copy.c's checks in its order, then one numpy assignment per
        run (numpy copies through a temporary where ranges overlap: memmove)."""
        if not 0 <= threads <= _COPY_MAX_THREADS:
            raise ValueError(
                f"copy_runs: threads is {threads}, expected 0 (default) to "
                f"{_COPY_MAX_THREADS}"
            )
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
    fmt = view.format
    native_order = "<" if sys.byteorder == "little" else ">"
    code = fmt[1:] if fmt[:1] in ("@", "=", native_order) else fmt
    if view.itemsize != 8 or code not in ("q", "l"):
        raise ValueError(
            f"copy_runs: runs has format '{fmt}' and itemsize {view.itemsize}, "
            "expected native int64 ('q' or 'l', itemsize 8)"
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


_TWIN = _Twin()


def sync_file_range_write(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset+nbytes)`` back to disk.

    Returns at once; durability still needs ``fsync``. Raises OSError.
    """
    if IMPL is not None:
        IMPL.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
    else:
        _TWIN.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def page_residency(fd: int, offset: int, nbytes: int) -> np.ndarray:
    """``uint8 [pages]``: 1 for each page of ``[offset, offset+nbytes)`` (from
    the page holding ``offset``) that the page cache holds, else 0.

    Raises:
        OSError: the file cannot be mapped (a filesystem without mmap).
        ValueError: a negative offset or size.
    """
    impl = IMPL if IMPL is not None else _TWIN
    return np.frombuffer(impl.page_residency(fd, offset, nbytes), dtype=np.uint8)


def cached_pages(fd: int, ranges: np.ndarray) -> np.ndarray:
    """``int64 [n]``: for each ``(offset, nbytes)`` row of ``ranges`` (int64
    ``[n, 2]``), how many pages of that range the page cache holds; an empty
    range holds none.

    Native: cachestat(2) per range, or where it is missing or filtered, one
    mincore over their span. Twin: :func:`page_residency` over the span.

    Raises:
        OSError: neither can be asked (a filesystem without mmap, a bad fd).
        ValueError: a negative offset or size.
    """
    pairs = np.ascontiguousarray(ranges, dtype=np.int64).reshape(-1, 2)
    if IMPL is not None:
        counts = np.frombuffer(IMPL.cached_pages(fd, pairs), dtype=np.uint64)
        return counts.astype(np.int64)
    bad = np.nonzero((pairs < 0).any(axis=1))[0]
    if len(bad):
        offset, nbytes = pairs[bad[0]].tolist()
        raise ValueError(
            f"cached_pages: range {bad[0]} has offset {offset} and nbytes "
            f"{nbytes}, expected both >= 0"
        )
    counts = np.zeros(len(pairs), dtype=np.int64)
    used = pairs[:, 1] > 0
    if not used.any():
        return counts
    page = mmap.PAGESIZE
    start = int(pairs[used, 0].min()) // page * page
    end = int((pairs[used, 0] + pairs[used, 1]).max())
    resident = np.frombuffer(_TWIN.page_residency(fd, start, end - start), np.uint8)
    totals = np.concatenate(([0], np.cumsum(resident, dtype=np.int64)))
    lo = (pairs[used, 0] - start) // page
    hi = (pairs[used, 0] + pairs[used, 1] - 1 - start) // page + 1
    counts[used] = totals[hi] - totals[lo]
    return counts


def pread_rows_xxh3(
    fd: int, parts: Sequence[tuple[Any, ...]], num_rows: int
) -> np.ndarray:
    """Read each ``(offset, buffer)`` or ``(offset, buffer, reversed)`` part
    of ``fd`` into its buffer (all of it), and return ``uint64 [num_rows]``:
    xxh3_64 of file row r of every part, as :func:`xxh3_rows` would give. A
    reversed part puts file row j in buffer row ``num_rows - 1 - j`` (a run of
    keys whose destination rows go down while the file's go up).

    Native: 256 KiB preads, each piece hashed while it is still in cache, GIL
    released: one pass over memory instead of a read and then a hash. Twin:
    ``os.preadv`` then :func:`xxh3_rows`.

    Raises:
        OSError: a read failed, or came back short (EIO: the file ends early).
        ValueError: no parts, more than 64, or a part that is not whole rows.
    """
    if IMPL is not None and hasattr(IMPL, "pread_rows_xxh3"):
        return np.frombuffer(IMPL.pread_rows_xxh3(fd, parts, num_rows), dtype="<u8")
    in_file_order = []
    for index, (offset, buffer, *flag) in enumerate(parts):
        view = memoryview(buffer).cast("B")
        if offset < 0 or num_rows < 1 or len(view) % num_rows:
            raise ValueError(
                f"pread_rows_xxh3: part {index} has offset {offset} and "
                f"{len(view)} bytes, expected offset >= 0 and a multiple of "
                f"{num_rows} rows"
            )
        rows = np.frombuffer(view, np.uint8).reshape(num_rows, -1)
        order = range(num_rows)[::-1] if flag and flag[0] else range(num_rows)
        for j, row in enumerate(order):
            _pread_full(fd, rows[row].data, offset + j * rows.shape[1])
        in_file_order.append(rows[list(order)])
    return xxh3_rows(in_file_order, num_rows)


def pread_layers_xxh3(
    fd: int, layers: Sequence[Sequence[tuple[Any, ...]]], num_rows: int
) -> np.ndarray:
    """:func:`pread_rows_xxh3` of each layer's parts; ``uint64 [len(layers),
    num_rows]``. Native: one call, the GIL released once for all of them
    (a verifier task reads 4-8 layers; per-layer calls spent their time
    taking the GIL back and parsing arguments). Twin: one call per layer.

    Raises:
        OSError: a read failed or came back short; which layer is not said.
        ValueError: no layers, or a layer ``pread_rows_xxh3`` would refuse.
    """
    if IMPL is not None and hasattr(IMPL, "pread_layers_xxh3"):
        found = np.frombuffer(IMPL.pread_layers_xxh3(fd, layers, num_rows), "<u8")
        return found.reshape(len(layers), num_rows)
    if not layers or num_rows < 1:
        raise ValueError(
            f"pread_layers_xxh3: found {len(layers)} layers and {num_rows} rows, "
            "expected >= 1 of each"
        )
    return np.stack([pread_rows_xxh3(fd, parts, num_rows) for parts in layers])


def _pread_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, "pread_rows_xxh3 (short read or I/O error)")
        done += got


def xxh3_rows(parts: Sequence[BufferLike], num_rows: int) -> np.ndarray:
    """``uint64 [num_rows]``: xxh3_64 of row r of every part, concatenated.

    Each part is a C-contiguous buffer of ``num_rows`` equal rows. Native: one
    call, GIL released (I/O threads run meanwhile). Twin: python-xxhash.
    """
    if IMPL is not None and hasattr(IMPL, "xxh3_rows"):
        return np.frombuffer(IMPL.xxh3_rows(parts, num_rows), dtype="<u8")
    if not parts or num_rows < 1:
        raise ValueError(
            f"xxh3_rows: found {len(parts)} parts and {num_rows} rows, expected "
            "1..64 parts and >= 1 row"
        )
    views = [memoryview(part).cast("B") for part in parts]
    for index, view in enumerate(views):
        if len(view) % num_rows:
            raise ValueError(
                f"xxh3_rows: part {index} has {len(view)} bytes, expected a "
                f"multiple of {num_rows} rows"
            )
    sizes = [len(view) // num_rows for view in views]
    sums = np.empty(num_rows, dtype="<u8")
    for row in range(num_rows):
        digest = xxhash.xxh3_64()
        for view, size in zip(views, sizes, strict=True):
            digest.update(view[row * size : (row + 1) * size])
        sums[row] = digest.intdigest()
    return sums


def copy_runs(
    srcs: Sequence[BufferLike],
    dsts: Sequence[BufferLike],
    runs: BufferLike,
    threads: int | None = None,
) -> int:
    """Copy many byte runs between buffers in one call; all are checked first.

    Row i of ``runs`` is ``(src_index, src_offset, dst_index, dst_offset,
    nbytes)``: ``nbytes`` bytes from ``srcs[src_index]`` at ``src_offset`` go to
    ``dsts[dst_index]`` at ``dst_offset``. Serves gathering many tensors' rows
    into one staging-ring region, scattering it back, and gathering the blocks
    of a paged buffer. Native: one call, the GIL released from ``_GIL_MINSIZE``
    bytes and the bytes shared among threads from ``_COPY_THREAD_MINSIZE``.
    Twin: one numpy assignment per run.

    Each run behaves as ``memmove`` (its source and destination may overlap).
    Single-threaded calls apply runs in order. Not guaranteed: any order among
    runs in a threaded call, so there no run's destination may overlap another
    run's source or destination; nor a consistent copy of a buffer that another
    thread writes meanwhile.

    Args:
        srcs: C-contiguous buffers (any dtype; offsets are in bytes).
        dsts: writable C-contiguous buffers.
        runs: native int64 ``[k, 5]``, C-contiguous (e.g. a numpy array).
        threads: threads for calls of ``_COPY_THREAD_MINSIZE`` bytes or more;
            None or 0: min(4, online CPUs). The twin ignores it.

    Returns:
        The bytes copied (the sum of ``nbytes``).

    Raises:
        ValueError: a run outside its buffers or with ``nbytes < 0`` (then
            nothing is copied); ``runs`` not int64 ``[k, 5]``; a src (dst)
            that is not a (writable) C-contiguous buffer; ``threads`` not in
            0..64. Each message names the run or argument, found vs expected.
        TypeError: ``srcs``/``dsts`` not sequences, or an item not a buffer.
    """
    num_threads = 0 if threads is None else threads
    if IMPL is not None and hasattr(IMPL, "copy_runs"):
        return int(IMPL.copy_runs(srcs, dsts, runs, threads=num_threads))
    return _TWIN.copy_runs(srcs, dsts, runs, num_threads)


_LITTLE = sys.byteorder == "little"


def _ptr_runs(fn: str, arrays: tuple[BufferLike, ...]) -> list[tuple[int, int, int]]:
    """``(src, dst, size)`` rows of three int64 arrays, checked as native/ptrs.c
    checks them."""
    columns: list[list[int]] = []
    for name, array in zip(("src_ptrs", "dst_ptrs", "sizes"), arrays, strict=True):
        view = memoryview(array)
        fmt = view.format
        code = fmt[1:] if fmt[:1] in ("@", "=", "<" if _LITTLE else ">") else fmt
        if (
            view.itemsize != 8
            or code not in ("q", "l")
            or view.ndim != 1
            or (not view.c_contiguous)
        ):
            raise ValueError(
                f"{fn}: {name} has format '{fmt}', itemsize {view.itemsize} and "
                f"{view.ndim} dimensions, expected a 1-D C-contiguous native int64 "
                "array"
            )
        columns.append(view.tolist())
        if len(columns[-1]) != len(columns[0]):
            raise ValueError(
                f"{fn}: {name} has {len(columns[-1])} entries and src_ptrs "
                f"{len(columns[0])}, expected equal lengths"
            )
    total = 0
    for index, (src, dst, size) in enumerate(zip(*columns, strict=True)):
        if size < 0:
            raise ValueError(f"{fn}: run {index} has size {size}, expected >= 0")
        if size > 0 and (src <= 0 or dst <= 0):
            raise ValueError(
                f"{fn}: run {index} has src {src} and dst {dst}, expected non-zero "
                f"addresses (> 0) for a run of {size} bytes"
            )
        total += size
        if total > sys.maxsize:
            raise ValueError(
                f"{fn}: the sizes add up to more than {sys.maxsize}, expected at "
                "most that"
            )
    return list(zip(*columns, strict=True))


def copy_ptrs(
    src_ptrs: BufferLike,
    dst_ptrs: BufferLike,
    sizes: BufferLike,
    threads: int | None = None,
) -> int:
    """Copy ``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]``.

    The CPU device backend's ``copy_runs``. The arrays are 1-D native int64
    (numpy) of one length; every run is checked first (size >= 0, non-zero
    addresses), the addresses themselves cannot be: the caller guarantees that
    each run lies in live memory it owns. Each run behaves as ``memmove``; as
    for :func:`copy_runs`, runs of a threaded call must not overlap each other.
    Native: GIL released from ``_GIL_MINSIZE`` bytes, threads from
    ``_COPY_THREAD_MINSIZE``. Twin: one ``ctypes.memmove`` per run.

    Returns:
        The bytes copied.

    Raises:
        ValueError: an array not 1-D int64, lengths that differ, a negative
            size or a zero address (then nothing is copied); ``threads`` not
            in 0..64.
    """
    num_threads = 0 if threads is None else threads
    if IMPL is not None:
        return int(IMPL.copy_ptrs(src_ptrs, dst_ptrs, sizes, threads=num_threads))
    if not 0 <= num_threads <= _COPY_MAX_THREADS:
        raise ValueError(
            f"copy_ptrs: threads is {num_threads}, expected 0 (default) to "
            f"{_COPY_MAX_THREADS}"
        )
    total = 0
    for src, dst, size in _ptr_runs("copy_ptrs", (src_ptrs, dst_ptrs, sizes)):
        if size > 0:
            ctypes.memmove(dst, src, size)
            total += size
    return total


def _device_impl(fn: str) -> ModuleType:
    if IMPL is None:
        raise OSError(
            errno.ENOSYS,
            f"{fn}: needs the C extension npukv_store._native, which is not in "
            "use (not built, stale, or NPUKV_NATIVE=0)",
        )
    return IMPL


# Runtime calls for npukv_store.device (native/device.c). No twin: without the
# extension each raises OSError(ENOSYS); a runtime library or symbol that is
# missing raises OSError (ENOENT/ENOSYS) naming it. The batches take the int64
# arrays of copy_ptrs, a kind (1 host to device, 2 device to host) and a raw
# stream handle, enqueue an async copy of every run, and return the bytes enqueued;
# a failed call raises RuntimeError after the runs before it are enqueued.


def cuda_memcpy_batch(
    src_ptrs: BufferLike,
    dst_ptrs: BufferLike,
    sizes: BufferLike,
    kind: int,
    stream: int,
    batch_api: bool = True,
) -> int:
    """Every run on ``stream``: one ``cuMemcpyBatchAsync`` where the driver has
    it (CUDA 12.8+) and ``batch_api``, else ``cudaMemcpyAsync`` per run. The
    batch matters: a stream queues about 1,000 operations, so behind a busy
    compute stream a loop of more runs blocks the host (native/device.c)."""
    impl = _device_impl("cuda_memcpy_batch")
    return int(
        impl.cuda_memcpy_batch(src_ptrs, dst_ptrs, sizes, kind, stream, batch_api)
    )


def cuda_copy_api() -> str:
    """The call the last ``cuda_memcpy_batch`` used: ``cuMemcpyBatchAsync`` or
    ``cudaMemcpyAsync``."""
    return str(_device_impl("cuda_copy_api").cuda_copy_api())


def acl_memcpy_batch(
    src_ptrs: BufferLike,
    dst_ptrs: BufferLike,
    sizes: BufferLike,
    kind: int,
    stream: int,
) -> int:
    """``aclrtMemcpyAsync(dst, n, src, n, kind, stream)`` per run."""
    impl = _device_impl("acl_memcpy_batch")
    return int(impl.acl_memcpy_batch(src_ptrs, dst_ptrs, sizes, kind, stream))


def acl_host_register(ptr: int, nbytes: int, flags: int) -> int:
    """``aclrtHostRegisterV2(ptr, nbytes, flags)`` (else ``aclrtHostRegister``
    MAPPED); the ACL error code, 0 on success."""
    return int(_device_impl("acl_host_register").acl_host_register(ptr, nbytes, flags))


def acl_host_unregister(ptr: int) -> int:
    """``aclrtHostUnregister(ptr)``; the ACL error code."""
    return int(_device_impl("acl_host_unregister").acl_host_unregister(ptr))


def cuda_get_last_error() -> int:
    """``cudaGetLastError()``: returns and clears the runtime's last error."""
    return int(_device_impl("cuda_get_last_error").cuda_get_last_error())
