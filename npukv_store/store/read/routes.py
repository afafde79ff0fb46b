"""The executors of a chunk read plan: one per route, one verify step for all.

Runs in: any process that reads; each executor runs on the thread it is given
(the reader's verifier threads, or the thread that called ``read_rows``).

    ChunkFiles       - the fds of one chunk read (buffered, and O_DIRECT when used)
    ChunkRead        - one chunk's read: header, rows, destination, verdicts
    read_cached()    - cached route: read and hash in one pass from the page cache
    read_streamed()  - streamed route: the same in file order, readahead ahead
    read_by_engine() - engine and direct routes: requests through an I/O engine
                       (a direct request is one on the O_DIRECT fd), each layer
                       verified when its last request completes

Every route ends in ``ChunkRead.compare``: found checksums against the chunk's
table, mismatches logged and counted, their rows added to the misses. Rows
whose read failed with an error are misses too, but not evidence of corruption
(a transient EIO may pass): ``io_failed`` keeps them apart.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Mapping

import numpy as np

from npukv_store import native
from npukv_store.io.direct import open_direct
from npukv_store.io.engine import READ, IOEngine, IORequest
from npukv_store.store.arrays import DestRows
from npukv_store.store.format import ChunkHeader, layer_checksums
from npukv_store.store.read.plan import ChunkReadPlan
from npukv_store.store.read.rows import ChunkRows
from npukv_store.store.stats import StoreCounters

logger = logging.getLogger(__name__)


class ChunkFiles:
    """The fds of one chunk read: the buffered one, and an O_DIRECT one opened
    when the plan has a direct request."""

    def __init__(self, path: str, fd: int, direct: bool) -> None:
        self.path = path
        self.fd = fd
        self.may_open_direct = direct  # False once the filesystem refuses
        self.random_advice = direct  # the fd was advised POSIX_FADV_RANDOM
        self.direct_fd: int | None = None

    def residency(self, ranges: np.ndarray) -> np.ndarray | None:
        """Per ``(offset, length)`` range, the share of its pages the page
        cache holds; None where that cannot be asked (no mmap)."""
        try:
            cached = native.cached_pages(self.fd, ranges)
        except OSError:
            return None
        page = mmap.PAGESIZE
        pages = (ranges[:, 0] + np.maximum(ranges[:, 1], 1) - 1) // page
        pages -= ranges[:, 0] // page - 1
        shares: np.ndarray = cached / pages
        return shares

    def open_direct(self) -> bool:
        """Open the O_DIRECT fd; False where the filesystem refuses O_DIRECT
        (then every read of this chunk is buffered)."""
        if self.direct_fd is None:
            # the same inode as the buffered fd, never the path looked up
            # again (it may be another file, or a symlink, by now)
            fd, direct = open_direct(f"/proc/self/fd/{self.fd}", os.O_RDONLY)
            if not direct:
                os.close(fd)
                self.may_open_direct = False
                return False
            self.direct_fd = fd
        return True

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)


class ChunkRead:
    """What every executor of one chunk's read shares."""

    def __init__(
        self,
        files: ChunkFiles,
        header: ChunkHeader,
        rows: ChunkRows,
        dest: Mapping[str, DestRows],
        counters: StoreCounters,
        verify: bool,
    ) -> None:
        self.files = files
        self.header = header
        self.rows = rows
        self.dest = dest
        self.counters = counters
        self.verify = verify
        self.io_failed: set[int] = set()  # rows whose read failed: not corrupt

    def compare(
        self,
        li: int,
        first: int,
        row: int,
        found: np.ndarray,
        bad: set[int],
        step: int = 1,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        """Add to ``bad`` the key indices (``first``, then ``step`` apart) whose
        checksums ``found`` (rows from ``row`` of layer ``li``) differ from the
        table; rows in ``skip`` failed to read and are not judged."""
        sums = self.header.checksums
        wrong = np.nonzero(found != sums[row : row + len(found), li])[0]
        if skip:
            wrong = wrong[[first + step * o not in skip for o in wrong.tolist()]]
        for offset in wrong.tolist():
            bad.add(first + step * offset)
            logger.warning(
                "checksum mismatch in %s row %d layer %d: a miss",
                self.header.path, row + offset, li,
            )  # fmt: skip
        if len(wrong):
            self.counters.add(checksum_errors=len(wrong))

    def check_layer(self, li: int, skip: frozenset[int]) -> set[int]:
        """Hash layer ``li``'s rows where they arrived and compare: one
        checksum call per run of consecutive rows (GIL-free when native)."""
        arrays = [self.dest[entry.name] for entry in self.header.layers[li]]
        bad: set[int] = set()
        for first, row, count in self.rows.runs:
            found = layer_checksums([a[first : first + count] for a in arrays], count)
            self.compare(li, first, row, found, bad, skip=skip)
        return bad


def read_cached(read: ChunkRead, layers: list[int]) -> set[int]:
    """Cached route: the layers, wholly in the page cache, read and hashed in
    one pass over memory (no engine copy, then a hash of the copy)."""
    return _read_in_one_pass(read, layers, "cached_read_bytes", file_order=False)


def read_streamed(read: ChunkRead, layers: list[int]) -> set[int]:
    """Streamed route: buffered reads that never go back in the file, hashed
    piece by piece as they arrive, so the kernel's readahead stays ahead."""
    return _read_in_one_pass(read, layers, "streamed_read_bytes", file_order=True)


def _read_in_one_pass(
    read: ChunkRead, layers: list[int], counter: str, *, file_order: bool
) -> set[int]:
    """One native call per run of rows for all ``layers`` (each 256 KiB piece
    hashed while in cache); returns the key indices that failed. In file order
    with several runs of rows that means layer by layer, each layer's runs in
    row order (the file holds a layer's rows together)."""
    header, rows, fd = read.header, read.rows, read.files.fd
    bad: set[int] = set()
    groups = [layers] if layers else []
    if file_order and len(rows.row_runs) > 1:
        groups = [[li] for li in layers]
    for group, (first, row, count, step) in (
        (group, run) for group in groups for run in rows.row_runs
    ):
        # keys of a run going down sit in memory in reverse file order
        low = first if step == 1 else first - count + 1
        layer_parts = [
            [
                (
                    entry.begin + row * entry.row_bytes,
                    read.dest[entry.name][low : low + count],
                    step == -1,
                )
                for entry in header.layers[li]
            ]
            for li in group
        ]
        try:
            found = native.pread_layers_xxh3(fd, layer_parts, count)
        except OSError as exc:
            read.counters.add(read_errors=1)
            logger.warning(
                "read of %s rows %d+%d layers %s failed: %s; a miss",
                header.path, row, count, group, exc,
            )  # fmt: skip
            bad.update(range(low, low + count))
            # EIO also means a short read: a file now shorter than its header
            # says is corrupt, anything else an I/O error that may pass
            if os.fstat(fd).st_size >= header.file_size:
                read.io_failed.update(range(low, low + count))
            continue
        moved = sum(part.nbytes for parts in layer_parts for _, part, _ in parts)
        read.counters.add(**{counter: moved})
        if read.verify:
            for li, layer_found in zip(group, found, strict=True):
                read.compare(li, first, row, layer_found, bad, step)
    return bad


def read_by_engine(
    read: ChunkRead,
    plan: ChunkReadPlan,
    engine: IOEngine,
    layer_arrived: Callable[[int, frozenset[int]], None],
) -> set[int]:
    """Engine and direct routes: ``plan.requests`` through ``engine``, queue
    depth in flight. When a layer's last request completes, ``layer_arrived``
    gets its index and the rows that failed so far (the reader hands its check
    to a verifier thread: this thread goes on reaping and submitting, so the
    disk never waits for a checksum). Returns the rows that failed to read."""
    files = read.files
    remaining = [0] * len(plan.layers)
    for request in plan.requests:
        for pos, _ in request.parts:
            remaining[pos] += 1
    direct_fd = files.direct_fd
    if any(r.direct for r in plan.requests):
        assert direct_fd is not None, "the reader opens the O_DIRECT fd first"
        read.counters.add(direct_read_bytes=plan.direct_bytes)
    requests = [
        IORequest(
            READ,
            direct_fd if r.direct and direct_fd is not None else files.fd,
            r.offset,
            tuple(s.dest.data for _, s in r.parts)
            if len(r.parts) > 1
            else r.parts[0][1].dest.data,
            tag,
        )
        for tag, r in enumerate(plan.requests)
    ]
    failed: set[int] = set()
    for done in engine.stream(requests):
        moved = done.result  # bytes, filling the request's segments in order
        if moved < 0:  # -errno: the rows miss, the file is no suspect
            read.counters.add(read_errors=1)
            logger.warning(
                "read of %s failed: %s; a miss", read.header.path, os.strerror(-moved)
            )
        for pos, (_, first, count, buffer) in plan.requests[done.tag].parts:
            if done.result < 0:
                read.io_failed.update(range(first, first + count))
            if moved < buffer.nbytes:  # short read (truncated file) or -errno
                failed.update(range(first, first + count))
            moved -= buffer.nbytes
            remaining[pos] -= 1
            if remaining[pos] == 0 and read.verify:
                layer_arrived(plan.layers[pos].layer, frozenset(read.io_failed))
    return failed
