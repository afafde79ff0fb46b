"""Reading rows of chunk files into caller buffers, verified.

Runs in: any process that reads; thread-safe (the header cache has a lock).

    ChunkReader.read_rows() - rows of one chunk into destination rows; returns
                              the key indices that were read and verified

Any doubt is a miss: a missing file (evicted after the lookup), a bad header,
another key at the row, a short read or a checksum mismatch. Rows are read with
``preadv`` straight into the caller's buffers, one iovec per run of consecutive
rows per tensor, file-adjacent runs merged into one call; checksums are computed
over the caller's buffer after the read, where the bytes will be used.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

from npukv_store.errors import FormatError
from npukv_store.spec import NamespaceSpec
from npukv_store.store.directory import CacheDir
from npukv_store.store.format import ChunkHeader, parse_header
from npukv_store.store.stats import StoreCounters

logger = logging.getLogger(__name__)

_IOV_MAX = 1024
_HEADER_CACHE_ENTRIES = 1024  # chunk files are immutable and ids never reused
Segment = tuple[int, int, int, np.ndarray]  # (file offset, first key, rows, dest)
Item = tuple[int, int]  # (key index, chunk row)


class ChunkReader:
    """Reads and verifies rows of one namespace's chunk files."""

    def __init__(
        self,
        cdir: CacheDir,
        spec: NamespaceSpec,
        namespace: str,
        counters: StoreCounters,
        *,
        verify: bool,
    ) -> None:
        self._dir = cdir
        self._spec = spec
        self._namespace = namespace
        self._counters = counters
        self._verify = verify
        self._lock = threading.Lock()
        self._headers: OrderedDict[int, ChunkHeader] = OrderedDict()

    def clear(self) -> None:
        """Forget cached headers (after fork)."""
        with self._lock:
            self._headers.clear()

    def read_rows(
        self,
        chunk_id: int,
        items: list[Item],
        keys: Sequence[bytes],
        layers: list[int],
        dest: dict[str, np.ndarray],
    ) -> list[int]:
        """Read ``items`` of one chunk into ``dest``; returns verified key indices.

        Args:
            items: ``(key index, row)`` pairs the index says live in the chunk.
            keys: the requested keys (checked against the chunk's own list).
            layers: layer indices to read.
            dest: tensor name -> ``uint8 [len(keys), row_bytes]`` destination.
        """
        path = self._dir.chunk_path(self._namespace, chunk_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return []  # evicted since the lookup, or unreadable: a miss
        try:
            header = self._header(chunk_id, fd, path)
            if header is None:
                return []
            items = [
                (i, r)
                for i, r in items
                if r < header.num_blocks and header.keys[r] == keys[i]
            ]
            return self._read_layers(fd, header, items, layers, dest)
        except OSError:
            self._counters.add(read_errors=1)
            logger.warning("read of chunk %s failed", path, exc_info=True)
            return []
        finally:
            os.close(fd)

    def _read_layers(
        self,
        fd: int,
        header: ChunkHeader,
        items: list[Item],
        layers: list[int],
        dest: dict[str, np.ndarray],
    ) -> list[int]:
        """Read and verify layer by layer. The whole range is announced first
        (WILLNEED), so the disk streams layer l+1 while layer l is verified."""
        plans = [_segments(header, items, li, dest) for li in layers]
        first = min((plan[0][0] for plan in plans if plan), default=0)
        end = max((p[-1][0] + p[-1][3].nbytes for p in plans if p), default=0)
        if end > first:
            os.posix_fadvise(fd, first, end - first, os.POSIX_FADV_WILLNEED)
        sums = header.checksums.tolist() if self._verify else []
        failed: set[int] = set()
        for li, plan in zip(layers, plans, strict=True):
            failed |= _preadv_segments(fd, plan)
            if self._verify:
                failed |= self._bad_rows(header, items, li, dest, sums)
        if failed:
            self._counters.add(checksum_errors=len(failed))
        return [i for i, _ in items if i not in failed]

    def _bad_rows(
        self,
        header: ChunkHeader,
        items: list[Item],
        li: int,
        dest: dict[str, np.ndarray],
        sums: list[list[int]],
    ) -> set[int]:
        """Key indices whose layer ``li`` does not match its checksum."""
        arrays = [dest[entry.name] for entry in header.layers[li]]
        bad = set()
        for i, row in items:
            digest = xxhash.xxh3_64(arrays[0][i])
            for array in arrays[1:]:
                digest.update(array[i])
            if digest.intdigest() != sums[row][li]:
                bad.add(i)
                logger.warning(
                    "checksum mismatch in %s row %d layer %d: a miss",
                    header.path,
                    row,
                    li,
                )
        return bad

    def _header(self, chunk_id: int, fd: int, path: str) -> ChunkHeader | None:
        with self._lock:
            header = self._headers.get(chunk_id)
            if header is not None:
                self._headers.move_to_end(chunk_id)
                return header
        try:
            header = parse_header(fd, path, namespace=self._namespace, spec=self._spec)
        except FormatError:
            self._counters.add(read_errors=1)
            logger.warning("bad chunk %s: treated as a miss", path, exc_info=True)
            return None
        with self._lock:
            self._headers[chunk_id] = header
            while len(self._headers) > _HEADER_CACHE_ENTRIES:
                self._headers.popitem(last=False)
        return header


def _segments(
    header: ChunkHeader, items: list[Item], li: int, dest: dict[str, np.ndarray]
) -> list[Segment]:
    """Reads of layer ``li`` for the items: one per run of consecutive rows that
    land in consecutive destination rows, per tensor; sorted by file offset."""
    runs: list[list[int]] = []  # [first key index, first row, count]
    for i, row in sorted(items, key=lambda item: item[1]):
        last = runs[-1] if runs else None
        if last and i == last[0] + last[2] and row == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([i, row, 1])
    segments = [
        (entry.begin + row * entry.row_bytes, i, count, dest[entry.name][i : i + count])
        for entry in header.layers[li]
        for i, row, count in runs
    ]
    segments.sort(key=lambda segment: segment[0])
    return segments


def _preadv_segments(fd: int, segments: list[Segment]) -> set[int]:
    """Read the segments, merging file-adjacent ones into one ``preadv``;
    returns the key indices whose rows were not filled (short read)."""
    failed: set[int] = set()
    start = 0
    while start < len(segments):
        offset = segments[start][0]
        end, cursor = start, offset
        while (
            end < len(segments)
            and end - start < _IOV_MAX
            and segments[end][0] == cursor
        ):
            cursor += segments[end][3].nbytes
            end += 1
        batch = segments[start:end]
        if os.preadv(fd, [seg[3].data for seg in batch], offset) != cursor - offset:
            for _, first, count, _ in batch:  # short read: the file was truncated
                failed.update(range(first, first + count))
        start = end
    return failed
