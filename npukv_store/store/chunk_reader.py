"""Reading rows of chunk files into caller buffers, verified.

Runs in: any process that reads; thread-safe (the header cache has a lock).

    ChunkReader.read_rows() - rows of one chunk into destination rows; returns
                              the key indices that were read and verified

Any doubt is a miss: a missing file (evicted after the lookup), a bad header,
another key at the row, a short read or a checksum mismatch. Rows are read with
``preadv`` straight into the caller's buffers, one iovec per run of consecutive
rows per tensor, file-adjacent runs merged into one call; checksums are computed
over the caller's buffer after the read, where the bytes will be used. Reads go
through an I/O engine (io_uring or threads) with ``io_queue_depth`` in flight,
and each layer is verified as soon as it has arrived.

With ``direct_io``, the first read of a chunk by this reader goes around the
page cache with O_DIRECT, straight into the caller's buffer, for every range the
cache does not (mostly) hold and whose offset, length and buffer address are
4096-aligned: on this VM's disk 1.9 GB/s against 1.5 buffered, with no kernel
copy competing for the cores. A chunk read again is read buffered, which admits
it to the page cache, so hot prefixes become warm hits while KV read once does
not push other data out of memory (docs/design.md §12). Ranges the cache holds
are always copied from it: a layer wholly in the cache is read and checksummed
in one pass over memory (``native.pread_layers_xxh3``) on the verifier threads,
not through the engine (docs/design.md §13). Layers read buffered that the
cache does not wholly hold, in segments larger than one engine request, are
streamed the same way, by one thread in file order, with kernel readahead ahead
of it (docs/design.md §19).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np

from npukv_store import native
from npukv_store.errors import FormatError
from npukv_store.io.direct import DIRECT_ALIGN_BYTES, open_direct
from npukv_store.io.engine import READ, IOEngine, IORequest, make_engine
from npukv_store.spec import NamespaceSpec
from npukv_store.store import policy
from npukv_store.store.arrays import DestRows
from npukv_store.store.directory import CacheDir
from npukv_store.store.format import ChunkHeader, layer_checksums, parse_header
from npukv_store.store.stats import StoreCounters

logger = logging.getLogger(__name__)

_HEADER_CACHE_ENTRIES = 1024  # chunk files are immutable and ids never reused
_READ_BEFORE_ENTRIES = 65536  # chunk ids read once: the page-cache admission set
Segment = tuple[int, int, int, np.ndarray]  # (file offset, first key, rows, dest)
Item = tuple[int, int]  # (key index, chunk row)
T = TypeVar("T")
#: Layers are read in file order: SEQUENTIAL doubles the readahead window of each
#: freshly opened chunk (measured +10-15% cold, docs/design.md §13).
_ADVICE = os.POSIX_FADV_SEQUENTIAL
#: Vectored reads: at most this many bytes and buffers per request.
_MAX_REQUEST_BYTES = 4 << 20
_MAX_IOVECS = 64
#: Threads that verify (and, for cached layers, read) one chunk's layers. On a
#: 16-core H200 host pread_rows_xxh3 from the page cache gave 4.1, 10.1 and
#: 15.0 GB/s on 1, 4 and 8 threads (docs/design.md §16); past 8 the gain is
#: small and the serving process needs its cores. At least 4 even on fewer
#: cores: on this 2-core VM 4 threads read warm 1 GiB calls at median 6.56 and
#: 6.85 GB/s against 6.03 and 6.47 with 2 (two A/B runs, 5 rounds each).
_VERIFY_THREADS = min(8, max(4, os.cpu_count() or 1))
#: Stream layers read buffered, not wholly cached, in segments larger than
#: _STREAM_ABOVE_BYTES, one engine request (docs/design.md §19). False sends
#: them through the engine, as before (kept for A/B runs and tests).
_STREAM_UNCACHED = True
_STREAM_ABOVE_BYTES = _MAX_REQUEST_BYTES
#: Cached layers of one chunk are read in this many verifier tasks of
#: consecutive layers, not one task per layer: warm 1 GiB one-call reads of
#: 2 MiB blocks (32 layers a chunk) gave a median 5.75 against 5.47 GB/s and
#: 5.81 against 5.67 (interleaved rounds; docs/design.md §19).
_CACHED_TASKS_PER_CHUNK = _VERIFY_THREADS
#: Chunks of one read call in flight at once: the next chunk's requests overlap
#: this one's last completions and checksums (docs/design.md §17). Three, not
#: two, since headers are read ahead (_load_headers): two chunks started
#: together finished together, and the disk idled while both hashed their last
#: layers. Cold 1 GiB one-call reads, medians of interleaved rounds: 1.523
#: against 1.451 GB/s (raw 1.660), 1.490 against 1.457, 1.724 against 1.589.
_CHUNKS_IN_FLIGHT = 3


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
        engine_kind: str = "auto",
        queue_depth: int = 16,
        direct: bool = False,
    ) -> None:
        self._dir = cdir
        self._spec = spec
        self._namespace = namespace
        self._counters = counters
        self._verify = verify
        self._lock = threading.Lock()
        self._headers: OrderedDict[int, ChunkHeader] = OrderedDict()
        self._engine_kind = engine_kind
        self._queue_depth = queue_depth
        self._direct = direct and hasattr(os, "O_DIRECT")
        self._engines = threading.local()  # one engine per reading thread
        self._all_engines: list[IOEngine] = []
        self._verify_pool: ThreadPoolExecutor | None = None
        self._chunk_pool: ThreadPoolExecutor | None = None
        self._corrupt: set[int] = set()  # chunk ids found corrupt, for the store
        self._missing: set[int] = set()  # chunk ids whose file was gone
        self._read_before: OrderedDict[int, None] = OrderedDict()

    def take_corrupt(self) -> set[int]:
        """Chunk ids whose header or checksums were found wrong since the last
        call (not I/O errors, which may pass)."""
        with self._lock:
            corrupt, self._corrupt = self._corrupt, set()
        return corrupt

    def take_missing(self) -> set[int]:
        """Chunk ids whose file was not found since the last call."""
        with self._lock:
            missing, self._missing = self._missing, set()
        return missing

    def _first_read(self, chunk_id: int) -> bool:
        """True the first time this reader reads ``chunk_id`` (recently); a
        second read is buffered and so admits the chunk to the page cache."""
        with self._lock:
            first = not policy.admit_on_read(chunk_id in self._read_before)
            self._read_before[chunk_id] = None
            self._read_before.move_to_end(chunk_id)
            while len(self._read_before) > _READ_BEFORE_ENTRIES:
                self._read_before.popitem(last=False)
        return first

    def _mark_corrupt(self, chunk_id: int) -> None:
        with self._lock:
            self._corrupt.add(chunk_id)
            self._headers.pop(chunk_id, None)

    def clear(self) -> None:
        """Forget cached headers and engines (after fork: their threads are gone)."""
        with self._lock:
            self._headers.clear()
            self._read_before.clear()
            self._all_engines = []
            self._verify_pool = None  # its thread did not survive the fork
            self._chunk_pool = None
        self._engines = threading.local()

    def read_chunks(
        self,
        chunks: list[tuple[int, list[Item]]],
        keys: Sequence[bytes],
        layers: list[int],
        dest: dict[str, DestRows],
    ) -> list[list[int]]:
        """``read_rows`` of each ``(chunk id, items)``, up to _CHUNKS_IN_FLIGHT
        chunks at once; per chunk, the verified key indices."""
        if len(chunks) > 1:
            self._load_headers([chunk_id for chunk_id, _ in chunks])
        if len(chunks) <= 1 or _CHUNKS_IN_FLIGHT <= 1:
            return [self.read_rows(c, items, keys, layers, dest) for c, items in chunks]
        with self._lock:
            if self._chunk_pool is None:
                self._chunk_pool = ThreadPoolExecutor(
                    _CHUNKS_IN_FLIGHT, thread_name_prefix="npukv-read"
                )
            pool = self._chunk_pool
        futures = [
            pool.submit(self.read_rows, c, items, keys, layers, dest)
            for c, items in chunks
        ]
        return _all_results(futures)

    def _load_headers(self, chunk_ids: list[int]) -> None:
        """Parse the headers of the chunks not in the header cache, all at
        once on the verifier threads, before any chunk's data is asked for.
        Read chunk by chunk, each header (two small reads) waited in the
        disk's queue behind the other chunk in flight's 64 MiB of data, 35-80
        ms, and the chunk's own data went out only after it: a cold 1 GiB read
        ran at 1.2 GB/s where the disk gave 1.6-2.0 (docs/design.md §20)."""
        with self._lock:
            missing = [c for c in chunk_ids if c not in self._headers]
        if len(missing) > 1:
            pool = self._verifier()
            wait([pool.submit(self._prefetch_header, c) for c in missing])

    def _prefetch_header(self, chunk_id: int) -> None:
        """Parse and cache one chunk's header; any problem is left for
        ``read_rows`` to find again, count and report (a miss there)."""
        path = self._dir.chunk_path(self._namespace, chunk_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            # no readahead: it would pull data pages into the page cache, and
            # the data read would then go through it instead of around it
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            header = parse_header(fd, path, namespace=self._namespace, spec=self._spec)
        except (OSError, FormatError):
            return
        finally:
            os.close(fd)
        self._cache_header(chunk_id, header)

    def read_rows(
        self,
        chunk_id: int,
        items: list[Item],
        keys: Sequence[bytes],
        layers: list[int],
        dest: dict[str, DestRows],
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
        except FileNotFoundError:
            # Evicted since the lookup (then the index no longer has it), or
            # deleted under the index: the store checks which (take_missing).
            with self._lock:
                self._missing.add(chunk_id)
            return []
        except OSError:
            self._counters.add(read_errors=1)
            return []  # unreadable: a miss
        direct = self._direct and self._first_read(chunk_id)
        # Reads around the cache: no readahead, or the header read would pull
        # megabytes of the data section into the cache (read_ahead_kb) and
        # those ranges would then be read buffered.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if direct else _ADVICE)
        files = _ChunkFiles(path, fd, direct)
        try:
            header = self._header(chunk_id, fd, path)
            if header is None:
                return []
            rows = _ChunkRows(
                [
                    (i, r)
                    for i, r in items
                    if r < header.num_blocks and header.keys[r] == keys[i]
                ]
            )
            good, corrupt = self._read_layers(files, header, rows, layers, dest)
            if corrupt:  # not for I/O errors: a transient EIO is no evidence
                self._mark_corrupt(chunk_id)
            return good
        except OSError as exc:
            self._counters.add(read_errors=1)
            logger.warning("read of chunk %s failed: %s; a miss", path, exc)
            return []
        finally:
            files.close()

    def _read_layers(
        self,
        files: _ChunkFiles,
        header: ChunkHeader,
        rows: _ChunkRows,
        layers: list[int],
        dest: dict[str, DestRows],
    ) -> tuple[list[int], bool]:
        """Read and verify every requested layer; returns the verified key
        indices, and whether some row is corrupt (a checksum mismatch or a
        short read; rows whose read failed with an error are misses only).

        Layers wholly in the page
        cache are read and hashed in one pass on the verifier threads; other
        layers read buffered in large segments are streamed in file order by
        one thread; the rest (O_DIRECT where ``files`` picks it) go through the engine,
        queue_depth requests in flight, and each such layer is verified as soon
        as its last read completes, so checksums of early layers overlap the
        disk reading later ones."""
        plans = [_segments(header, rows, li, dest) for li in layers]
        found_shares = files.cached_shares([seg for plan in plans for seg in plan])
        # unknown (no mmap): treat as uncached, as before residency was asked
        shares = (
            np.zeros(sum(map(len, plans))) if found_shares is None else found_shares
        )
        sums = header.checksums
        io_failed: set[int] = set()  # rows whose read failed: not corrupt
        checks = []
        owners: list[tuple[int, Segment]] = []  # request tag -> (layer pos, segment)
        owner_shares: list[float] = []
        remaining = []
        cached_layers: set[int] = set()
        cached_verified: list[int] = []  # layer indices read on verifier threads
        seen = 0
        for pos, plan in enumerate(plans):
            plan_shares = shares[seen : seen + len(plan)]
            seen += len(plan)
            cached = bool((plan_shares == 1.0).all())
            if cached and self._verify:
                # Wholly in the page cache: read and hash in one pass over
                # memory on a verifier thread (layers in parallel), not a copy
                # by the engine and then a hash of the copy.
                cached_verified.append(layers[pos])
                remaining.append(0)
                continue
            if cached:  # unverified: the engine's workers copy it in parallel
                cached_layers.add(pos)
            remaining.append(len(plan))
            owners.extend((pos, segment) for segment in plan)
            owner_shares.extend(plan_shares.tolist())
        # a few tasks of consecutive layers each, not one task per layer
        tasks = min(len(cached_verified), _CACHED_TASKS_PER_CHUNK)
        for t in range(tasks):
            lo = t * len(cached_verified) // tasks
            hi = (t + 1) * len(cached_verified) // tasks
            checks.append(
                self._verifier().submit(
                    self._read_buffered_layers,
                    files.fd,
                    header,
                    rows,
                    cached_verified[lo:hi],
                    dest,
                    sums,
                    "cached_read_bytes",
                    False,
                    io_failed,
                )
            )
        fds = files.pick(
            [segment for _, segment in owners],
            None if found_shares is None else np.asarray(owner_shares),
        )
        if files.random_advice and any(fd != files.direct_fd for fd in fds):
            # some ranges are read buffered after all (unaligned destination,
            # mostly cached): give them back the readahead RANDOM took away
            os.posix_fadvise(files.fd, 0, 0, _ADVICE)
        # Layers read buffered, not wholly cached, in segments larger than an
        # engine request are streamed: one thread reads them in file order and
        # hashes each piece as it arrives, kernel readahead ahead of it.
        # Through the engine each such segment is one huge request, and several
        # at far-apart offsets of one file ran up to 2x slower cold than one
        # stream; segments of a request or less, in file order, are one
        # sequential window for the engine, which read those faster and
        # steadier than a stream (docs/design.md §19).
        buffered = {
            pos for pos, (_, _, _, rows) in owners if rows.nbytes > _STREAM_ABOVE_BYTES
        } - cached_layers
        if not _STREAM_UNCACHED:
            buffered.clear()
        buffered -= {
            pos for fd, (pos, _) in zip(fds, owners, strict=True) if fd != files.fd
        }
        streamed = sorted(buffered, key=lambda pos: plans[pos][0][0])
        if streamed:
            kept = [i for i, (pos, _) in enumerate(owners) if pos not in buffered]
            owners = [owners[i] for i in kept]
            fds = [fds[i] for i in kept]
        stream_task = (
            files.fd, header, rows, [layers[p] for p in streamed], dest, sums,
            "streamed_read_bytes", True, io_failed,
        )  # fmt: skip
        if streamed and owners:  # the engine reads the rest meanwhile
            checks.append(
                self._verifier().submit(self._read_buffered_layers, *stream_task)
            )
        if files.direct_fd is not None:
            self._counters.add(
                direct_read_bytes=sum(
                    segment[3].nbytes
                    for fd, (_, segment) in zip(fds, owners, strict=True)
                    if fd == files.direct_fd
                )
            )
        groups = _file_adjacent_groups(
            [segment for _, segment in owners], fds, files.direct_fd
        )
        requests = [
            IORequest(
                READ,
                fds[group[0]],
                owners[group[0]][1][0],
                tuple(owners[i][1][3].data for i in group)
                if len(group) > 1
                else owners[group[0]][1][3].data,
                tag,
            )
            for tag, group in enumerate(groups)
        ]
        failed: set[int] = set()
        try:
            if streamed and not owners:  # nothing for the engine: stream here
                failed |= self._read_buffered_layers(*stream_task)
            for done in self._engine().stream(requests):
                moved = done.result  # bytes, filling the group's segments in order
                if moved < 0:  # -errno: the rows miss, the file is no suspect
                    self._counters.add(read_errors=1)
                    logger.warning(
                        "read of %s failed: %s; a miss",
                        header.path, os.strerror(-moved),
                    )  # fmt: skip
                for index in groups[done.tag]:
                    pos, (_, first, count, buffer) = owners[index]
                    if done.result < 0:
                        io_failed.update(range(first, first + count))
                    if moved < buffer.nbytes:  # short read (truncated file) or -errno
                        failed.update(range(first, first + count))
                    moved -= buffer.nbytes
                    remaining[pos] -= 1
                    if remaining[pos] == 0 and self._verify:
                        # On the verifier thread (GIL-free C): this thread goes on
                        # reaping and submitting, so the disk never waits for a
                        # checksum.
                        checks.append(
                            self._verifier().submit(
                                self._bad_rows,
                                header,
                                rows,
                                layers[pos],
                                dest,
                                sums,
                                frozenset(io_failed),
                            )  # fmt: skip
                        )
        finally:
            # the cached layers' reads write into ``dest``: never leave one
            # running behind an exception
            wait(checks)
        for bad in _all_results(checks):
            failed |= bad
        good = [i for i, _ in rows.items if i not in failed]
        return good, bool(failed - io_failed)

    def _verifier(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._verify_pool is None:
                # Completions arrive in bursts (a whole 64 MiB chunk is 16
                # requests in flight), so the layers of the last burst are
                # hashed after the disk is done: on several cores at once.
                self._verify_pool = ThreadPoolExecutor(
                    _VERIFY_THREADS, thread_name_prefix="npukv-verify"
                )
            return self._verify_pool

    def _engine(self) -> IOEngine:
        engine: IOEngine | None = getattr(self._engines, "engine", None)
        if engine is None:
            engine = make_engine(self._engine_kind, self._queue_depth)
            self._engines.engine = engine
            with self._lock:
                self._all_engines.append(engine)
        return engine

    def close(self) -> None:
        """Release the engines of every thread that read, and the verifier."""
        with self._lock:
            engines, self._all_engines = self._all_engines, []
            pools = [self._chunk_pool, self._verify_pool]
            self._chunk_pool = self._verify_pool = None
        for pool in pools:  # chunk readers first: they submit to the verifier
            if pool is not None:
                pool.shutdown(wait=True)
        for engine in engines:
            engine.close()
        self._engines = threading.local()

    def _bad_rows(
        self,
        header: ChunkHeader,
        rows: _ChunkRows,
        li: int,
        dest: dict[str, DestRows],
        sums: np.ndarray,
        skip: frozenset[int] = frozenset(),
    ) -> set[int]:
        """Key indices whose layer ``li`` does not match its checksum: one
        checksum call per run of consecutive rows (GIL-free when native).
        Rows in ``skip`` failed to read: they are not compared."""
        arrays = [dest[entry.name] for entry in header.layers[li]]
        bad: set[int] = set()
        for first, row, count in rows.runs:
            found = layer_checksums([a[first : first + count] for a in arrays], count)
            self._compare(header, li, first, row, found, sums, bad, skip=skip)
        return bad

    def _read_buffered_layers(
        self,
        fd: int,
        header: ChunkHeader,
        rows: _ChunkRows,
        layer_indices: list[int],
        dest: dict[str, DestRows],
        sums: np.ndarray,
        counter: str,
        file_order: bool = False,
        io_failed: set[int] | None = None,
    ) -> set[int]:
        """Read the layers buffered (from the page cache, or through it) and
        verify them in the same pass: one native call per run of rows for all
        the layers (each 256 KiB piece hashed while in cache; the checksums
        are compared only when this reader verifies). Their bytes count in
        ``counter``; returns the key indices that failed (those whose read
        failed are also added to ``io_failed``).

        ``file_order`` (streaming, ``layer_indices`` in file order): the reads
        never go back in the file, so the kernel's readahead stays ahead of
        them. With several runs of rows that means layer by layer, each
        layer's runs in row order (the file holds a layer's rows together)."""
        bad: set[int] = set()
        groups = [layer_indices] if layer_indices else []
        if file_order and len(rows.row_runs) > 1:
            groups = [[li] for li in layer_indices]
        for group, (first, row, count, step) in (
            (group, run) for group in groups for run in rows.row_runs
        ):
            # keys of a run going down sit in memory in reverse file order
            low = first if step == 1 else first - count + 1
            layer_parts = [
                [
                    (
                        entry.begin + row * entry.row_bytes,
                        dest[entry.name][low : low + count],
                        step == -1,
                    )
                    for entry in header.layers[li]
                ]
                for li in group
            ]
            try:
                found = native.pread_layers_xxh3(fd, layer_parts, count)
            except OSError as exc:
                self._counters.add(read_errors=1)
                logger.warning(
                    "read of %s rows %d+%d layers %s failed: %s; a miss",
                    header.path, row, count, group, exc,
                )  # fmt: skip
                bad.update(range(low, low + count))
                # The native call says EIO for a short read too: a file now
                # shorter than its header says is corrupt, anything else an
                # I/O error that may pass.
                if io_failed is not None and os.fstat(fd).st_size >= header.file_size:
                    io_failed.update(range(low, low + count))
                continue
            moved = sum(part.nbytes for parts in layer_parts for _, part, _ in parts)
            self._counters.add(**{counter: moved})
            if self._verify:
                for li, layer_found in zip(group, found, strict=True):
                    self._compare(header, li, first, row, layer_found, sums, bad, step)
        return bad

    def _compare(
        self,
        header: ChunkHeader,
        li: int,
        first: int,
        row: int,
        found: np.ndarray,
        sums: np.ndarray,
        bad: set[int],
        step: int = 1,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        """Add to ``bad`` the key indices (``first``, then ``step`` apart) whose
        checksums ``found`` (rows from ``row`` of layer ``li``) differ from the
        table."""
        wrong = np.nonzero(found != sums[row : row + len(found), li])[0]
        if skip:
            wrong = wrong[[first + step * o not in skip for o in wrong.tolist()]]
        for offset in wrong.tolist():
            bad.add(first + step * offset)
            logger.warning(
                "checksum mismatch in %s row %d layer %d: a miss",
                header.path,
                row + offset,
                li,
            )
        if len(wrong):
            self._counters.add(checksum_errors=len(wrong))

    def _header(self, chunk_id: int, fd: int, path: str) -> ChunkHeader | None:
        with self._lock:
            header = self._headers.get(chunk_id)
            if header is not None:
                self._headers.move_to_end(chunk_id)
                return header
        try:
            header = parse_header(fd, path, namespace=self._namespace, spec=self._spec)
        except FormatError as exc:
            self._counters.add(read_errors=1)
            logger.warning("bad chunk, treated as a miss: %s", exc)
            self._mark_corrupt(chunk_id)
            return None
        self._cache_header(chunk_id, header)
        return header

    def _cache_header(self, chunk_id: int, header: ChunkHeader) -> None:
        with self._lock:
            self._headers[chunk_id] = header
            while len(self._headers) > _HEADER_CACHE_ENTRIES:
                self._headers.popitem(last=False)


class _ChunkFiles:
    """The fds of one chunk read: the buffered one, and an O_DIRECT one opened
    when some segment is worth reading around the page cache."""

    def __init__(self, path: str, fd: int, direct: bool) -> None:
        self.path = path
        self.fd = fd
        self._may_open_direct = direct  # False once the filesystem refuses
        self.random_advice = direct  # the fd was advised POSIX_FADV_RANDOM
        self.direct_fd: int | None = None

    def cached_shares(self, segments: list[Segment]) -> np.ndarray | None:
        """Per segment, the share of its pages the page cache holds; None
        where that cannot be asked (a filesystem without mmap)."""
        if not segments:
            return np.zeros(0)
        ranges = np.array(
            [(offset, dest.nbytes) for offset, _, _, dest in segments], dtype=np.int64
        )
        try:
            cached = native.cached_pages(self.fd, ranges)
        except OSError:
            return None
        page = mmap.PAGESIZE
        pages = (ranges[:, 0] + np.maximum(ranges[:, 1], 1) - 1) // page
        pages -= ranges[:, 0] // page - 1
        shares: np.ndarray = cached / pages
        return shares

    def pick(self, segments: list[Segment], shares: np.ndarray | None) -> list[int]:
        """The fd each segment is read through: O_DIRECT where its range is
        aligned, its destination is aligned and the page cache holds less than
        ``policy.CACHED_SHARE`` of it; else the buffered fd."""
        fds = [self.fd] * len(segments)
        if not self._may_open_direct or shares is None:
            return fds
        for i, (offset, _, _, dest) in enumerate(segments):
            unaligned = (offset | dest.nbytes | dest.ctypes.data) % DIRECT_ALIGN_BYTES
            if not policy.read_around_cache(float(shares[i]), unaligned == 0):
                continue
            direct_fd = self._open_direct()
            if direct_fd is None:
                return [self.fd] * len(segments)
            fds[i] = direct_fd
        return fds

    def _open_direct(self) -> int | None:
        if self.direct_fd is None:
            fd, direct = open_direct(self.path, os.O_RDONLY)
            if not direct:  # the filesystem refuses O_DIRECT: buffered it is
                os.close(fd)
                self._may_open_direct = False
                return None
            self.direct_fd = fd
        return self.direct_fd

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)


def _all_results(futures: Sequence[Future[T]]) -> list[T]:
    """Every future's result, in order. All of them finish before an exception
    (the first one) is raised: a task still running would go on writing into
    the caller's buffers after the call that owns them has failed."""
    wait(futures)
    return [future.result() for future in futures]


def _file_adjacent_groups(
    segments: list[Segment], fds: list[int], merge_fd: int | None
) -> list[list[int]]:
    """Segment indices grouped into requests, in file order: segments read
    through ``merge_fd`` (the O_DIRECT fd) whose file ranges follow each other
    share one vectored read, up to _MAX_REQUEST_BYTES and _MAX_IOVECS; every
    other segment is a request of its own. Cold chunks then go to the disk in
    4 MiB requests whatever the destination tensors are (1 MiB per tensor
    segment: about 12% slower here), while cached segments stay separate
    requests, which io_uring's workers copy on several cores (one 4 MiB copy
    per worker: warm 4.6 against 6.9 GB/s unverified; docs/design.md §13)."""
    order = sorted(range(len(segments)), key=lambda i: (fds[i], segments[i][0]))
    groups: list[list[int]] = []
    end = size = -1
    for i in order:
        offset, nbytes = segments[i][0], segments[i][3].nbytes
        group = groups[-1] if groups else None
        if (
            group is not None
            and fds[i] == merge_fd
            and fds[group[0]] == fds[i]
            and offset == end
            and size + nbytes <= _MAX_REQUEST_BYTES
            and len(group) < _MAX_IOVECS
        ):
            group.append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
        end = offset + nbytes
    return groups


class _ChunkRows:
    """The items of one chunk read with their runs, worked out once per chunk:
    planned again for every layer and tensor, they took a tenth of a warm
    read's time (docs/design.md §20)."""

    __slots__ = ("items", "runs", "row_runs")

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.runs = _runs(items)
        self.row_runs = _row_runs(items)


def _segments(
    header: ChunkHeader, rows: _ChunkRows, li: int, dest: dict[str, DestRows]
) -> list[Segment]:
    """Reads of layer ``li`` for the items: one per run of consecutive rows that
    land in consecutive destination rows, per tensor; sorted by file offset."""
    segments = [
        (entry.begin + row * entry.row_bytes, i, count, dest[entry.name][i : i + count])
        for entry in header.layers[li]
        for i, row, count in rows.runs
    ]
    segments.sort(key=lambda segment: segment[0])
    return segments


def _row_runs(items: list[Item]) -> list[tuple[int, int, int, int]]:
    """``(key index of the first row, first row, count, step)`` of maximal runs
    of consecutive rows whose key index goes up (step 1) or down (step -1) by
    one per row: a run going down is one range of the file whose keys' rows
    sit in memory in reverse order (vLLM's descending block ids)."""
    runs: list[list[int]] = []
    for i, row in sorted(items, key=lambda item: item[1]):
        last = runs[-1] if runs else None
        if last and row == last[1] + last[2]:
            step = i - (last[0] + last[3] * (last[2] - 1))
            if step in (1, -1) and (last[2] == 1 or step == last[3]):
                last[2] += 1
                last[3] = step
                continue
        runs.append([i, row, 1, 1])
    return [(first, row, count, step) for first, row, count, step in runs]


def _runs(items: list[Item]) -> list[tuple[int, int, int]]:
    """``(first key index, first row, count)`` of maximal runs in which both the
    key index and the row go up by one."""
    runs: list[list[int]] = []
    for i, row in sorted(items, key=lambda item: item[1]):
        last = runs[-1] if runs else None
        if last and i == last[0] + last[2] and row == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([i, row, 1])
    return [(first, row, count) for first, row, count in runs]
