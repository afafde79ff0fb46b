"""What the page cache holds of a namespace's chunk files, and hints to it.

Runs in: any process, through a KVStore handle; thread-safe (each call opens
and closes its own fds).

    PageCache.readahead()     - WILLNEED on the chunk files holding some keys
    PageCache.cached_prefix() - how many leading keys sit in chunk files the
                                page cache mostly holds

Both are best effort: a chunk evicted meanwhile is simply not hinted, or ends
the cached prefix. Neither reads data: residency is one cachestat (or mincore)
per chunk file (``native.cached_pages``).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence

import numpy as np

from npukv_store import native
from npukv_store.store.directory import CacheDir
from npukv_store.store.index import Index


class PageCache:
    """The page-cache side of one store handle: ``index`` is called for the
    handle's current index (it is reopened after fork); a chunk counts as
    cached from ``cached_share`` of its pages (``ReadTuning.cached_share``)."""

    def __init__(
        self, cdir: CacheDir, index: Callable[[], Index], cached_share: float
    ) -> None:
        self.dir = cdir
        self._index = index
        self.cached_share = cached_share

    def readahead(self, keys: Sequence[bytes]) -> int:
        """Hint the kernel to start reading the chunks holding ``keys``.

        Best effort and non-blocking; returns how many chunk files were hinted.
        """
        chunks = {loc[0] for loc in self._index().locate(keys) if loc is not None}
        hinted = 0
        for chunk_id in chunks:
            fd = self._open_chunk(chunk_id)
            if fd is None:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                hinted += 1
            except OSError:
                pass
            finally:
                os.close(fd)
        return hinted

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored in chunk files the page cache
        mostly holds: the part of a hit that loads at memory speed. Stops at
        the first other key."""
        shares: dict[int, bool] = {}
        count = 0
        for loc in self._index().locate(keys):
            if loc is None:
                break
            chunk_id = loc[0]
            if chunk_id not in shares:
                shares[chunk_id] = self._mostly_cached(chunk_id)
            if not shares[chunk_id]:
                break
            count += 1
        return count

    def _open_chunk(self, chunk_id: int) -> int | None:
        """A read-only fd of a published chunk's file; None where it is gone
        (evicted meanwhile: its read will miss)."""
        record = self._index().chunk(chunk_id)
        if record is None:
            return None
        path = self.dir.chunk_path(record.namespace.hex(), chunk_id)
        try:
            return self.dir.open_file(path, os.O_RDONLY)  # never via a symlink
        except OSError:
            return None

    def _mostly_cached(self, chunk_id: int) -> bool:
        fd = self._open_chunk(chunk_id)
        if fd is None:
            return False
        try:
            size = os.fstat(fd).st_size
            cached = int(native.cached_pages(fd, np.array([[0, size]]))[0])
        except (OSError, ValueError):
            return False
        finally:
            os.close(fd)
        pages = -(-size // mmap.PAGESIZE)
        return pages > 0 and cached / pages >= self.cached_share
