"""The C extension ``npukv_store._native``, or its pure-Python twin; picked once.

Runs in: any process. At import this module binds its entry points either to
the C extension or, only where ``NPUKV_NATIVE=0``, to ``npukv_store._twin``
(the same tests run against both, as py-lmdb does with ``LMDB_FORCE_CFFI``).
A build that is missing, broken or stale (another ``ABI_VERSION``) is an
ImportError naming what was found and the fix; nothing falls back silently.

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
                              npukv_store.device; native only: on the twin
                              they raise OSError(ENOSYS)
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

#: anything with the buffer protocol (collections.abc.Buffer needs Python 3.12)
BufferLike = Any

ABI_VERSION = 9  # native/module.c NKV_ABI_VERSION
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


def _refusal(found: str) -> str:
    return (
        f"npukv_store._native: found {found}, expected a build with ABI_VERSION "
        f"{ABI_VERSION}; rebuild it (`pip install -e .` in the repository), or "
        "set NPUKV_NATIVE=0 to use the pure-Python twin (slower)"
    )


def _load() -> ModuleType | None:
    """The C module, checked; None where NPUKV_NATIVE=0 asks for the twin."""
    if os.environ.get("NPUKV_NATIVE", "1") == "0":
        return None
    try:
        from npukv_store import _native
    except ImportError as exc:
        raise ImportError(
            _refusal(f"no loadable build ({exc})"), name="npukv_store._native"
        ) from exc
    # getattr: a build older than ABI_VERSION itself has none
    found = getattr(_native, "ABI_VERSION", None)
    if found != ABI_VERSION:
        raise ImportError(
            _refusal(f"a stale build with ABI_VERSION {found} ({_native.__file__})"),
            name="npukv_store._native",
        )
    return _native


#: the C module in use, or None on the twin (for Uring and the device calls)
IMPL = _load()
IS_NATIVE = IMPL is not None

# The entry points, bound once. Both modules take the same arguments and
# return bytes: _native.pyi says how (stubtest checks it against the build,
# mypy the twin against it), and the wrappers below convert for both.
if IMPL is None:
    # from this part size the C code hashes through an L2-sized bounce
    # buffer (native/checksum.c); the twin reads in place, mirroring the value
    from npukv_store._twin import BOUNCE_ABOVE_BYTES as BOUNCE_ABOVE_BYTES
    from npukv_store._twin import cached_pages as _cached_pages
    from npukv_store._twin import copy_ptrs as _copy_ptrs
    from npukv_store._twin import copy_runs as _copy_runs
    from npukv_store._twin import page_residency as _page_residency
    from npukv_store._twin import pread_layers_xxh3 as _pread_layers_xxh3
    from npukv_store._twin import pread_rows_xxh3 as _pread_rows_xxh3
    from npukv_store._twin import sync_file_range as _sync_file_range
    from npukv_store._twin import xxh3_rows as _xxh3_rows
else:
    from npukv_store._native import BOUNCE_ABOVE_BYTES as BOUNCE_ABOVE_BYTES
    from npukv_store._native import cached_pages as _cached_pages
    from npukv_store._native import copy_ptrs as _copy_ptrs
    from npukv_store._native import copy_runs as _copy_runs
    from npukv_store._native import page_residency as _page_residency
    from npukv_store._native import pread_layers_xxh3 as _pread_layers_xxh3
    from npukv_store._native import pread_rows_xxh3 as _pread_rows_xxh3
    from npukv_store._native import sync_file_range as _sync_file_range
    from npukv_store._native import xxh3_rows as _xxh3_rows


def sync_file_range_write(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset+nbytes)`` back to disk.

    Returns at once; durability still needs ``fsync``. Raises OSError, or
    ValueError for a negative offset or size.
    """
    _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def page_residency(fd: int, offset: int, nbytes: int) -> np.ndarray:
    """``uint8 [pages]``: 1 for each page of ``[offset, offset+nbytes)`` (from
    the page holding ``offset``) that the page cache holds, else 0.

    Raises:
        OSError: the file cannot be mapped (a filesystem without mmap).
        ValueError: a negative offset or size, or offset + size past 2**63 - 1.
    """
    return np.frombuffer(_page_residency(fd, offset, nbytes), dtype=np.uint8)


def cached_pages(fd: int, ranges: np.ndarray) -> np.ndarray:
    """``int64 [n]``: for each ``(offset, nbytes)`` row of ``ranges`` (int64
    ``[n, 2]``), how many pages of that range the page cache holds; an empty
    range holds none.

    Native: cachestat(2) per range, or where it is missing or filtered, one
    mincore over their span. Twin: :func:`page_residency` over the span.

    Raises:
        OSError: neither can be asked (a filesystem without mmap, a bad fd).
        ValueError: a negative offset or size, or offset + size past 2**63 - 1.
    """
    pairs = np.ascontiguousarray(ranges, dtype=np.int64).reshape(-1, 2)
    return np.frombuffer(_cached_pages(fd, pairs), dtype=np.uint64).astype(np.int64)


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
        ValueError: no parts, more than 64, a part that is not whole rows or
            whose offset + size passes 2**63 - 1, or ``num_rows`` outside
            1..2**53 - 1 (_twin._MAX_ROWS: empty parts are whole rows of any
            count, and the digests and row states must stay addressable).
    """
    return np.frombuffer(_pread_rows_xxh3(fd, parts, num_rows), dtype="<u8")


def pread_layers_xxh3(
    fd: int, layers: Sequence[Sequence[tuple[Any, ...]]], num_rows: int
) -> np.ndarray:
    """:func:`pread_rows_xxh3` of each layer's parts; ``uint64 [len(layers),
    num_rows]``. Native: one call, the GIL released once for all of them
    (a verifier task reads 4-8 layers; per-layer calls spent their time
    taking the GIL back and parsing arguments). Twin: one call per layer.

    Raises:
        OSError: a read failed or came back short; which layer is not said.
        ValueError: no layers, layers x ``num_rows`` past 2**53 - 1, or a
            layer ``pread_rows_xxh3`` would refuse.
    """
    found = np.frombuffer(_pread_layers_xxh3(fd, layers, num_rows), dtype="<u8")
    return found.reshape(len(layers), num_rows)


def xxh3_rows(parts: Sequence[BufferLike], num_rows: int) -> np.ndarray:
    """``uint64 [num_rows]``: xxh3_64 of row r of every part, concatenated.

    Each part is a C-contiguous buffer of ``num_rows`` equal rows (1 to 64
    parts). Native: one call, GIL released (I/O threads run meanwhile). Twin:
    python-xxhash.

    Raises:
        ValueError: no parts, more than 64, a part that is not whole rows, or
            ``num_rows`` outside 1..2**53 - 1.
    """
    return np.frombuffer(_xxh3_rows(parts, num_rows), dtype="<u8")


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
            None or 0: min(4, online CPUs). The twin checks it, then ignores it.

    Returns:
        The bytes copied (the sum of ``nbytes``).

    Raises:
        ValueError: a run outside its buffers or with ``nbytes < 0`` (then
            nothing is copied); ``runs`` not int64 ``[k, 5]``; a src (dst)
            that is not a (writable) C-contiguous buffer; more than 2**57 - 1
            runs (_twin._MAX_RUNS); ``threads`` not in 0..64. Each message
            names the run or argument, found vs expected.
        TypeError: ``srcs``/``dsts`` not sequences, or an item not a buffer.
    """
    num_threads = 0 if threads is None else threads
    return int(_copy_runs(srcs, dsts, runs, threads=num_threads))


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
        ValueError: an array not 1-D int64, lengths that differ, more than
            2**57 - 1 runs, a negative size, a zero address or a run ending
            past address 2**63 - 1 (then nothing is copied); ``threads`` not
            in 0..64.
    """
    num_threads = 0 if threads is None else threads
    return int(_copy_ptrs(src_ptrs, dst_ptrs, sizes, threads=num_threads))


# Runtime calls for npukv_store.device (native/device.c). No twin: on it each
# raises OSError(ENOSYS); a runtime library or symbol that is missing raises
# OSError (ENOENT/ENOSYS) naming it. The batches take the int64 arrays of
# copy_ptrs, a kind (1 host to device, 2 device to host) and a raw stream
# handle, enqueue an async copy of every run, and return the bytes enqueued; a
# failed call raises RuntimeError after the runs before it are enqueued.
# Unlike the entry points above they look IMPL up when called, as io/uring.py
# does for Uring: a test sets IMPL to None to see what the twin's process sees
# (tests/device/test_device.py), and a registration or a batch costs far more
# than the lookup.


def _device_impl(fn: str) -> ModuleType:
    if IMPL is None:
        raise OSError(
            errno.ENOSYS,
            f"{fn}: needs the C extension npukv_store._native, which is not in "
            "use (NPUKV_NATIVE=0)",
        )
    return IMPL


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
