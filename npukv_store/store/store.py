"""KVStore: the on-disk block store facade over chunk files and the shared index.

Runs in: any process; many processes may open the same cache directory at once.
A handle is thread-safe; after fork() it reopens its index in the child.

    put()    - write a batch of blocks as one chunk and publish it
    lookup() - longest stored prefix of a key chain
    read()   - rows of named tensors (whole blocks or single layers) into buffers
    stats()  - directory-wide and process-local counters
    check()  - verify every invariant (see :mod:`.check`); the tests' oracle

Safety: a chunk is written under tmp/, fsynced (``fsync=chunk``), renamed into
``<ns>/chunks/`` and only then committed to the index, so a reader never sees a
partial chunk. Reads treat any doubt (missing file, short read, bad header, key
or checksum mismatch) as a miss for the affected blocks: the caller recomputes.
What is *not* guaranteed: a lookup hit can turn into a read miss if another
process evicts the chunk in between.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from npukv_store.config import StoreConfig
from npukv_store.errors import FormatError, NamespaceMismatch
from npukv_store.hashing import chain_hashes, namespace_fingerprint
from npukv_store.spec import NamespaceSpec
from npukv_store.store import recovery
from npukv_store.store.arrays import byte_rows
from npukv_store.store.directory import HOST, CacheDir
from npukv_store.store.format import (
    ChunkHeader,
    build_chunk,
    layer_checksum,
    parse_header,
)
from npukv_store.store.index import ChunkRecord
from npukv_store.store.stats import PutResult, StoreCounters, StoreStats

logger = logging.getLogger(__name__)

_IOV_MAX = 1024
_HEADER_CACHE_ENTRIES = 1024  # parsed headers; chunk files are immutable
_TOUCH_FLUSH_S = 1.0  # how stale the shared LRU may get for read-only processes


class KVStore:
    """A handle on one namespace of a shared cache directory.

    Args:
        config: the store configuration (``cache_dir``, ``capacity``, ...).
        spec: the namespace (model, layout, rank); it names the chunk directory
            and seeds the block keys.

    Raises:
        ConfigError: cache_dir is unusable.
        FormatError: the directory marker or namespace.json is foreign.
    """

    def __init__(self, config: StoreConfig, spec: NamespaceSpec) -> None:
        self.config = config
        self.spec = spec
        self.fingerprint = namespace_fingerprint(spec)
        self.namespace = self.fingerprint.hex()
        self.dir = CacheDir(config.cache_dir)
        self.counters = StoreCounters()
        self._lock = threading.Lock()
        self._in_flight: set[bytes] = set()
        self._headers: OrderedDict[int, ChunkHeader] = OrderedDict()
        self._touched: set[bytes] = set()  # chunk ids (8 bytes LE) read
        self._touched_keys: set[bytes] = set()  # keys found by lookups
        self._closed = threading.Event()
        self._touch_thread: threading.Thread | None = None
        self._open()

    def _open(self) -> None:
        self._pid = os.getpid()
        self.dir.open()
        with self.dir.locked():
            self.index = recovery.open_index(
                self.dir, map_size=self.config.index_map_size, sync=self._sync
            )
            recovery.remove_garbage(self.dir, self.index, self.config.tmp_max_age_s)
            self._ensure_namespace_dir()

    @property
    def _sync(self) -> bool:
        return self.config.fsync == "chunk"

    def _ensure_namespace_dir(self) -> None:
        os.makedirs(
            os.path.join(self.dir.ns_dir(self.namespace), "chunks"), exist_ok=True
        )
        path = os.path.join(self.dir.ns_dir(self.namespace), "namespace.json")
        text = self.spec.canonical_json()
        try:
            with open(path, encoding="utf-8") as handle:
                found = handle.read()
        except FileNotFoundError:
            tmp = self.dir.tmp_path("namespace")
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(tmp, path)  # same content from every writer: last one wins
            return
        if found != text:
            raise NamespaceMismatch(
                f"{path}: holds {found[:120]!r}..., expected the spec {text[:120]!r}..."
            )

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # LMDB handles must not cross fork()
            self._headers.clear()
            self._in_flight.clear()
            self._touch_thread = None
            self._open()

    def keys_for(
        self, tokens: Sequence[int] | np.ndarray, extra: bytes = b""
    ) -> list[bytes]:
        """Block keys of ``tokens`` in this namespace (full blocks only)."""
        return chain_hashes(tokens, self.spec.block_size, self.fingerprint, extra)

    # -- put ------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], tensors: Mapping[str, object]) -> PutResult:
        """Store a batch of blocks as one chunk.

        Args:
            keys: one 16-byte key per block (row).
            tensors: every tensor name of the namespace -> an array (numpy or CPU
                torch) shaped ``[len(keys), *row_shape]`` of the part's dtype.

        Returns:
            How many rows were stored, skipped (already stored or in flight in
            this process) or rejected for lack of room. Keys already stored by
            another process are skipped; two processes racing on one key both
            write, the first commit wins and the loser's row is dead space.

        Raises:
            ValueError: keys or tensors do not match the namespace.
            OSError: the chunk could not be written (nothing is published).
        """
        self._check_fork()
        rows = self._input_rows(keys, tensors)
        fresh = self._claim(keys)
        try:
            return self._put_claimed(keys, rows, fresh)
        finally:
            with self._lock:
                self._in_flight.difference_update(keys[i] for i in fresh)

    def _input_rows(
        self, keys: Sequence[bytes], tensors: Mapping[str, object]
    ) -> dict[str, np.ndarray]:
        if not keys or any(not isinstance(k, bytes) or len(k) != 16 for k in keys):
            raise ValueError("keys: expected a non-empty list of 16-byte keys")
        expected = self.spec.tensor_names()
        if sorted(tensors) != sorted(expected):
            raise ValueError(f"tensors: found {sorted(tensors)}, expected {expected}")
        parts = {
            f"{lay.name}.{p.name}": p for lay in self.spec.layers for p in lay.parts
        }
        return {n: byte_rows(tensors[n], parts[n], len(keys), n) for n in expected}

    def _claim(self, keys: Sequence[bytes]) -> list[int]:
        """Indices of keys not stored and not in flight; marks them in flight."""
        locations = self.index.locate(keys)
        fresh, seen = [], set()
        with self._lock:
            for i, key in enumerate(keys):
                if (
                    locations[i] is None
                    and key not in self._in_flight
                    and key not in seen
                ):
                    fresh.append(i)
                    seen.add(key)
            self._in_flight.update(seen)
        return fresh

    def _put_claimed(
        self, keys: Sequence[bytes], rows: dict[str, np.ndarray], fresh: list[int]
    ) -> PutResult:
        skipped = len(keys) - len(fresh)
        if not fresh:
            self.counters.add(skipped_blocks=skipped)
            return PutResult(stored=0, skipped=skipped, rejected=0)
        if len(fresh) < len(keys):
            rows = {name: view[fresh] for name, view in rows.items()}
            keys = [keys[i] for i in fresh]
        chunk_id = secrets.randbits(63) + 1
        path = self.dir.chunk_path(self.namespace, chunk_id)
        created = time.time_ns()
        size = self._write_chunk(chunk_id, keys, rows, path, created)
        record = ChunkRecord(
            chunk_id,
            self.fingerprint,
            size,
            len(keys),
            0,
            created,
            created,
            tuple(keys),
        )
        try:
            result = self.index.commit_chunk(
                record,
                capacity_bytes=self.config.capacity,
                grace_ns=int(self.config.evict_grace_s * 1e9),
                touched=self._take_touches(),
            )
        except BaseException:
            _unlink(path)
            raise
        if result.rejected or result.live_rows == 0:
            _unlink(path)  # published nothing: no index row points at it
        for victim in result.victims:
            _unlink(self.dir.chunk_path(victim.namespace.hex(), victim.chunk_id))
        stored = result.live_rows
        rejected = len(keys) if result.rejected else 0
        self.counters.add(
            puts=1,
            put_blocks=stored,
            put_bytes=size if stored else 0,
            skipped_blocks=skipped + len(keys) - stored - rejected,
            rejected_blocks=rejected,
            evicted_chunks=len(result.victims),
        )
        return PutResult(
            stored=stored,
            skipped=len(keys) - stored - rejected + skipped,
            rejected=rejected,
        )

    def _write_chunk(
        self,
        chunk_id: int,
        keys: Sequence[bytes],
        rows: dict[str, np.ndarray],
        path: str,
        created: int,
    ) -> int:
        """Write the chunk under tmp/, fsync per policy, rename into place."""
        buffers = build_chunk(
            self.spec,
            self.namespace,
            keys,
            {n: np.ascontiguousarray(v).data.cast("B") for n, v in rows.items()},
            creator=f"{os.getpid()}@{HOST}",
            created_ns=created,
        )
        tmp = self.dir.tmp_path(chunk_id)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            size = _write_all(fd, buffers)
            if self._sync:
                os.fsync(fd)
            os.rename(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        finally:
            os.close(fd)
        if self._sync:
            _fsync_dir(os.path.dirname(path))
        return size

    # -- lookup and read -------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` that are stored (a hit is not a promise:
        the chunk may be evicted before it is read, which reads as a miss)."""
        self._check_fork()
        count = self.index.lookup_prefix(keys)
        if count:
            with self._lock:  # resolved to chunk ids later, off the lookup path
                self._touched_keys.update(keys[:count])
            self._record_touches(set())
        self.counters.add(lookups=1, hit_blocks=count, lookup_blocks=len(keys))
        return count

    def read(self, keys: Sequence[bytes], out: Mapping[str, object]) -> list[bool]:
        """Read blocks into caller buffers.

        Args:
            keys: the blocks to read.
            out: tensor name -> writable array ``[len(keys), *row_shape]``. The
                names pick the layers read; a layer's parts come all or none.

        Returns:
            Per key, True when every requested layer was read and verified.
            False means a miss: not stored, gone, unreadable or corrupt; the
            row's contents are then unspecified and must be recomputed.
        """
        self._check_fork()
        layers, dest = self._output_rows(keys, out)
        ok = [False] * len(keys)
        by_chunk: dict[int, list[tuple[int, int]]] = {}
        for i, loc in enumerate(self.index.locate(keys)):
            if loc is not None:
                by_chunk.setdefault(loc[0], []).append((i, loc[1]))
        for chunk_id, items in by_chunk.items():
            good = self._read_chunk(chunk_id, items, keys, layers, dest)
            for i in good:
                ok[i] = True
        hits = sum(ok)
        self.counters.add(
            read_blocks=hits,
            read_misses=len(keys) - hits,
            read_bytes=hits * sum(self.spec.layers[li].row_bytes for li in layers),
        )
        return ok

    def _output_rows(
        self, keys: Sequence[bytes], out: Mapping[str, object]
    ) -> tuple[list[int], dict[str, np.ndarray]]:
        layers, dest = [], {}
        for li, layer in enumerate(self.spec.layers):
            names = layer.tensor_names()
            present = [n in out for n in names]
            if any(present) and not all(present):
                raise ValueError(f"out: layer {layer.name!r} needs all of {names}")
            if all(present):
                layers.append(li)
                for name, part in zip(names, layer.parts, strict=True):
                    dest[name] = byte_rows(
                        out[name], part, len(keys), name, writable=True
                    )
        unknown = set(out) - set(dest)
        if unknown or not layers:
            raise ValueError(
                f"out: found {sorted(out)}, expected tensor names of {self.namespace}"
            )
        return layers, dest

    def _read_chunk(
        self,
        chunk_id: int,
        items: list[tuple[int, int]],
        keys: Sequence[bytes],
        layers: list[int],
        dest: dict[str, np.ndarray],
    ) -> list[int]:
        """Read ``(key index, row)`` items of one chunk; returns verified indices."""
        path = self.dir.chunk_path(self.namespace, chunk_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return []  # evicted meanwhile, or unreadable: a miss
        try:
            header = self._header(chunk_id, fd, path)
            if header is None:
                return []
            items = [
                (i, r)
                for i, r in items
                if r < header.num_blocks and header.keys[r] == keys[i]
            ]
            segments = sorted(
                (
                    (entry.begin + row * entry.row_bytes, i, dest[entry.name][i])
                    for li in layers
                    for entry in header.layers[li]
                    for i, row in items
                ),
                key=lambda segment: segment[0],
            )
            failed = _preadv_segments(fd, segments)
        except OSError:
            self.counters.add(read_errors=1)
            logger.warning("read of chunk %s failed", path, exc_info=True)
            return []
        finally:
            os.close(fd)
        self._record_touches({chunk_id.to_bytes(8, "little")})
        verify = self.config.verify == "always"
        good = []
        for i, row in items:
            if i in failed:
                continue
            if verify and not all(
                layer_checksum([dest[e.name][i] for e in header.layers[li]])
                == int(header.checksums[row, li])
                for li in layers
            ):
                self.counters.add(checksum_errors=1)
                logger.warning(
                    "checksum mismatch in %s row %d: treated as a miss", path, row
                )
                continue
            good.append(i)
        return good

    def _header(self, chunk_id: int, fd: int, path: str) -> ChunkHeader | None:
        with self._lock:
            header = self._headers.get(chunk_id)
            if header is not None:
                self._headers.move_to_end(chunk_id)
                return header
        try:
            header = parse_header(fd, path, namespace=self.namespace, spec=self.spec)
        except FormatError:
            self.counters.add(read_errors=1)
            logger.warning("bad chunk %s: treated as a miss", path, exc_info=True)
            return None
        with self._lock:
            self._headers[chunk_id] = header
            while len(self._headers) > _HEADER_CACHE_ENTRIES:
                self._headers.popitem(last=False)
        return header

    # -- LRU touches -----------------------------------------------------------

    def _record_touches(self, chunk_ids: set[bytes]) -> None:
        with self._lock:
            self._touched |= chunk_ids
            if self._touch_thread is None:
                self._touch_thread = threading.Thread(
                    target=self._touch_loop, name="npukv-touch", daemon=True
                )
                self._touch_thread.start()

    def _take_touches(self) -> set[bytes]:
        with self._lock:
            touched, self._touched = self._touched, set()
            keys, self._touched_keys = list(self._touched_keys), set()
        for location in self.index.locate(keys) if keys else ():
            if location is not None:
                touched.add(location[0].to_bytes(8, "little"))
        return touched

    def _touch_loop(self) -> None:
        """Publish this process's reads to the shared LRU about once a second,
        off the lookup path, so lookups never wait for the index write lock."""
        while not self._closed.wait(_TOUCH_FLUSH_S):
            self.flush_touches()

    def flush_touches(self) -> None:
        """Write pending LRU touches to the index now."""
        touched = self._take_touches()
        if touched and os.getpid() == self._pid:
            try:
                self.index.touch(touched, time.time_ns())
            except Exception:  # a cache hint: losing it only ages the chunk
                logger.warning("LRU touch failed", exc_info=True)

    # -- the rest --------------------------------------------------------------

    def stats(self) -> StoreStats:
        """Directory-wide totals from the index plus this handle's counters."""
        self._check_fork()
        total, chunks, blocks = self.index.totals()
        return StoreStats(
            total_bytes=total,
            capacity_bytes=self.config.capacity,
            num_chunks=chunks,
            num_blocks=blocks,
            counters=self.counters.snapshot(),
        )

    def check(self, *, verify_data: bool = False, fix: bool = False) -> list[str]:
        """Verify every invariant of the directory; returns the problems found.

        Args:
            verify_data: also read every live row and check its checksums.
            fix: delete crash leftovers (tmp garbage, orphan chunk files).
        """
        from npukv_store.store.check import check_store

        self._check_fork()
        self.flush_touches()
        return check_store(
            self.dir, self.index, self.config, verify_data=verify_data, fix=fix
        )

    def close(self) -> None:
        """Flush touches and release the index. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if os.getpid() == self._pid:
            self.flush_touches()
            self.index.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_all(fd: int, buffers: list[memoryview]) -> int:
    total = 0
    pending = [b for b in buffers if len(b)]
    while pending:
        batch = pending[:_IOV_MAX]
        done = os.writev(fd, batch)
        total += done
        # short writes are legal: drop what was written, resume mid-buffer
        while done:
            if done >= len(pending[0]):
                done -= len(pending.pop(0))
            else:
                pending[0] = pending[0][done:]
                done = 0
    return total


def _preadv_segments(fd: int, segments: list[tuple[int, int, np.ndarray]]) -> set[int]:
    """Read ``(file offset, key index, destination row)`` segments, merging
    file-adjacent ones into one ``preadv``; returns key indices not filled."""
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
            cursor += segments[end][2].nbytes
            end += 1
        batch = segments[start:end]
        if os.preadv(fd, [row.data for _, _, row in batch], offset) != cursor - offset:
            failed.update(i for _, i, _ in batch)  # short read: file truncated
        start = end
    return failed


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # already removed: same outcome
        os.unlink(path)
