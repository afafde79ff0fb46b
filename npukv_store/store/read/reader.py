"""Reading rows of chunk files into caller buffers, verified.

Runs in: any process that reads; thread-safe (the header cache has a lock).

    ChunkReader.read_chunks() - rows of several chunks, a few chunks in flight
    ChunkReader.read_rows()   - rows of one chunk into destination rows; returns
                                the key indices that were read and verified
    ChunkReader.plan()        - the plan a read of a chunk would follow now

A read of one chunk: open the file (the first read of a chunk by this reader
may go around the page cache: ``policy.admit_on_read``; never in a namespace
several workers load, ``loaded_by_several_workers``), get its header (cached;
read ahead for the other chunks of a call), keep the items whose row holds the
asked key, plan every layer's route (``.plan``: pure, from the page cache's
residency and ``ReadTuning``), run the routes (``.routes``) and collect the
verdicts. Any doubt is a miss: a missing file (evicted after the lookup), a bad
header, another key at the row, a short read or a checksum mismatch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from npukv_store.errors import FormatError
from npukv_store.io.engine import IOEngine, make_engine
from npukv_store.spec import NamespaceSpec
from npukv_store.store import calibration, policy
from npukv_store.store.arrays import DestRows
from npukv_store.store.directory import CacheDir
from npukv_store.store.format import ChunkHeader
from npukv_store.store.read.headers import ChunkHeaders
from npukv_store.store.read.plan import (
    ChunkReadPlan,
    ReadTuning,
    plan_chunk_read,
    whole_chunk_plan,
)
from npukv_store.store.read.routes import (
    ChunkFiles,
    ChunkRead,
    read_by_engine,
    read_cached,
    read_streamed,
)
from npukv_store.store.read.rows import ChunkRows, Item
from npukv_store.store.stats import StoreCounters

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        tuning: ReadTuning | None = None,
    ) -> None:
        self.tuning = tuning or ReadTuning()
        self._advice = (
            os.POSIX_FADV_SEQUENTIAL
            if self.tuning.sequential_advice
            else os.POSIX_FADV_NORMAL
        )
        self._dir = cdir
        self._spec = spec
        self._namespace = namespace
        self._counters = counters
        self._verify = verify
        self._lock = threading.Lock()
        self._headers = ChunkHeaders(
            cdir, spec, namespace, self.tuning.header_cache_entries
        )
        self._engine_kind = engine_kind
        self._queue_depth = queue_depth
        # every worker of a shared namespace loads every hit: reads that
        # went around the page cache would each go to the disk
        self.shared = (
            loaded_by_several_workers(spec) and self.tuning.buffered_when_shared
        )
        self._direct = direct and hasattr(os, "O_DIRECT") and not self.shared
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
            while len(self._read_before) > self.tuning.read_before_entries:
                self._read_before.popitem(last=False)
        return first

    def _direct_first(self) -> bool:
        """``tuning.direct_first_reads``, from the directory's calibration
        where the tuning leaves it open (and then the calibration's other
        fields too: calibration.derived_tuning): read once, at the first read
        (the store has opened the directory by then), never raising."""
        choice = self.tuning.direct_first_reads
        if choice is None:
            derived = calibration.derived_tuning(calibration.load(self._dir))
            self.tuning = dataclasses.replace(self.tuning, **derived)
            choice = bool(derived["direct_first_reads"])
        return choice

    def _mark_corrupt(self, chunk_id: int) -> None:
        with self._lock:
            self._corrupt.add(chunk_id)
        self._headers.drop(chunk_id)

    def clear(self) -> None:
        """Forget cached headers and engines (after fork: their threads are gone)."""
        self._headers.drop()
        with self._lock:
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
        """``read_rows`` of each ``(chunk id, items)``, up to
        ``tuning.chunks_in_flight`` chunks at once (the next chunk's requests
        overlap this one's last completions and checksums); per chunk, the
        verified key indices."""
        in_flight = self.tuning.chunks_in_flight
        if len(chunks) > 1:
            ids = [chunk_id for chunk_id, _ in chunks]
            self._headers.prefetch(ids, self._verifier())
        if len(chunks) <= 1 or in_flight <= 1:
            return [self.read_rows(c, items, keys, layers, dest) for c, items in chunks]
        with self._lock:
            if self._chunk_pool is None:
                self._chunk_pool = ThreadPoolExecutor(
                    in_flight, thread_name_prefix="npukv-read"
                )
            pool = self._chunk_pool
        futures = [
            pool.submit(self.read_rows, c, items, keys, layers, dest)
            for c, items in chunks
        ]
        return _all_results(futures)

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
            fd = self._dir.open_file(path, os.O_RDONLY)  # never via a symlink
        except FileNotFoundError:
            # Evicted since the lookup (then the index no longer has it), or
            # deleted under the index: the store checks which (take_missing).
            with self._lock:
                self._missing.add(chunk_id)
            return []
        except OSError:
            self._counters.add(read_errors=1)
            return []  # unreadable: a miss
        direct = self._direct and self._direct_first() and self._first_read(chunk_id)
        # Reads around the cache: no readahead, or the header read would pull
        # megabytes of the data section into the cache (read_ahead_kb) and
        # those ranges would then be read buffered.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if direct else self._advice)
        files = ChunkFiles(path, fd, direct)
        try:
            header = self._header(chunk_id, fd, path)
            if header is None:
                return []
            rows = ChunkRows(
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
        files: ChunkFiles,
        header: ChunkHeader,
        rows: ChunkRows,
        layers: list[int],
        dest: dict[str, DestRows],
    ) -> tuple[list[int], bool]:
        """Plan the read, then run each route; returns the verified key
        indices, and whether some row is corrupt (a checksum mismatch or a
        short read; rows whose read failed with an error are misses only)."""
        plan = self._plan(files, header, rows, layers, dest)
        read = ChunkRead(files, header, rows, dest, self._counters, self._verify)
        pool = self._verifier()
        checks = [pool.submit(read_cached, read, list(t)) for t in plan.cached_tasks]
        if files.random_advice and plan.readahead:
            # some ranges are read buffered after all (unaligned destination,
            # mostly cached): give them back the readahead RANDOM took away
            os.posix_fadvise(files.fd, 0, 0, self._advice)
        streamed = list(plan.streamed)
        if streamed and plan.requests:  # the engine reads the rest meanwhile
            checks.append(pool.submit(read_streamed, read, streamed))

        def layer_arrived(li: int, skip: frozenset[int]) -> None:
            checks.append(pool.submit(read.check_layer, li, skip))

        failed: set[int] = set()
        try:
            if streamed and not plan.requests:  # nothing for the engine: here
                failed |= read_streamed(read, streamed)
            if plan.requests:
                failed |= read_by_engine(read, plan, self._engine(), layer_arrived)
        finally:
            # the other routes write into ``dest``: never leave one running
            # behind an exception
            wait(checks)
        for bad in _all_results(checks):
            failed |= bad
        good = [i for i, _ in rows.items if i not in failed]
        return good, bool(failed - read.io_failed)

    def _plan(
        self,
        files: ChunkFiles,
        header: ChunkHeader,
        rows: ChunkRows,
        layers: list[int],
        dest: dict[str, DestRows],
    ) -> ChunkReadPlan:
        def plan() -> ChunkReadPlan:
            return plan_chunk_read(
                header, rows, layers, dest, files.residency, self.tuning,
                first_read=files.may_open_direct, verify=self._verify,
            )  # fmt: skip

        chosen = plan()
        if any(r.direct for r in chosen.requests) and not files.open_direct():
            chosen = plan()  # the filesystem refuses O_DIRECT: all buffered
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("read plan of %s:\n%s", header.path, chosen.explain())
        return chosen

    def plan(self, chunk_id: int) -> ChunkReadPlan | None:
        """The plan a read of every row and layer of ``chunk_id`` into aligned
        buffers (as the staging ring's) would follow now, from the page
        cache's residency; None where the chunk cannot be read. For ``npukv
        inspect --plan``: reads the header only, and is not counted as a read."""
        path = self._dir.chunk_path(self._namespace, chunk_id)
        first = self._direct and self._direct_first()
        with self._lock:
            direct = first and chunk_id not in self._read_before
        try:
            fd = self._dir.open_file(path, os.O_RDONLY)  # never via a symlink
        except OSError:
            return None
        files = ChunkFiles(path, fd, direct)
        try:
            header = self._header(chunk_id, fd, path)
            if header is None:
                return None
            return whole_chunk_plan(
                header, files.residency, self.tuning,
                first_read=direct, verify=self._verify,
            )  # fmt: skip
        finally:
            files.close()

    def _verifier(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._verify_pool is None:
                # Completions arrive in bursts (a whole 64 MiB chunk is 16
                # requests in flight), so the layers of the last burst are
                # hashed after the disk is done: on several cores at once.
                self._verify_pool = ThreadPoolExecutor(
                    self.tuning.verify_threads, thread_name_prefix="npukv-verify"
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

    def _header(self, chunk_id: int, fd: int, path: str) -> ChunkHeader | None:
        try:
            return self._headers.get(chunk_id, fd, path)
        except FormatError as exc:
            self._counters.add(read_errors=1)
            logger.warning("bad chunk, treated as a miss: %s", exc)
            self._mark_corrupt(chunk_id)
            return None


def loaded_by_several_workers(spec: NamespaceSpec) -> bool:
    """Whether several processes load every hit of ``spec``'s namespace: MLA's
    latent cache under TP > 1, one namespace that every TP worker reads whole
    (``connector/namespace.py``). Their first reads are buffered: the first
    worker's read fills the page cache, and a worker that asks for a page
    being read waits for that one I/O instead of reading it again
    (docs/decisions/0063)."""
    return spec.rank_independent and spec.tp_size > 1


def _all_results(futures: Sequence[Future[T]]) -> list[T]:
    """Every future's result, in order. All of them finish before an exception
    (the first one) is raised: a task still running would go on writing into
    the caller's buffers after the call that owns them has failed."""
    wait(futures)
    return [future.result() for future in futures]
