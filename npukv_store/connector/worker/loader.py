"""Layer-by-layer loads: store -> registered host slots -> device pages.

Runs in: the worker process. ``run`` on the forward thread (bulk mode) or on
the loader thread (``submit``: layerwise and asynchronous loads); each layer's
read and copy on one of ``prefetch_depth`` reader threads; ``wait_layer`` and
``settle`` on the forward thread.

One job holds every block loaded in one step, per KV cache group (a layer
reads the blocks of its own group). Layers are issued in model order, each to
a reader thread with its own host slot: the read, its verification, then the
H2D copy on the transfer stream. At most ``prefetch_depth`` layers are open at
once: in a layerwise job layer ``j`` is issued only once the forward has
waited on layer ``j - depth`` (or moved past it), so with depth 1 no read runs
ahead of the compute, and with depth ``d`` the reads of ``d`` layers overlap
each other and the compute. A slot is reused once its previous H2D copy has
completed. The transfer stream first waits on an event the compute stream
recorded when the job was created: vLLM may still be zeroing the newly
allocated destination blocks on the compute stream. That event, not
``wait_stream``, because a ``wait_stream`` issued later from the loader thread
would also wait for the attention work enqueued meanwhile and serialise loads
behind compute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npukv_store.connector.worker.block_runs import build_runs
from npukv_store.connector.worker.host_buffer import HostBuffer
from npukv_store.connector.worker.pages import LayerLayout
from npukv_store.connector.worker.remote_loads import RemoteLoads
from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)

_UNGATED = 1 << 30  # "the forward has passed every layer"


@dataclass(frozen=True, slots=True)
class LoadLayer:
    """One layer as the loader reads it."""

    tensor: str  # its tensor name in the group's namespace ("<layer>.page")
    layout: LayerLayout
    group: int  # its KV cache group: whose keys, block ids and store


@dataclass
class LoadJob:
    """One step's loads, all requests together, per KV cache group."""

    keys: list[list[bytes]]  # per group
    block_ids: list[list[int]]  # per group
    ready: Any  # event on the compute stream: destinations may be written
    done: list[Any]  # per layer: the H2D copy's event, None until issued
    waited: list[bool]  # per layer: the compute stream was made to wait on it
    errors: set[int] = field(default_factory=set)  # block ids not loaded
    #: errors already handed to vLLM before the job settled (StepLoads.take_errors)
    reported: set[int] = field(default_factory=set)
    #: layers the forward has reached (wait_layer) or passed; layer j is issued
    #: once j < consumed + depth. Bulk and asynchronous jobs are never gated.
    consumed: int = _UNGATED
    finished: bool = False
    started: float = field(default_factory=time.perf_counter)
    ended: float = 0.0  # when its last layer was read and its copy issued
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: asynchronous loads: request id -> its block ids (to report per request)
    requests: dict[str, set[int]] = field(default_factory=dict)
    #: the store's (cached, disk) read byte counters when it started (costs.py)
    read_before: tuple[int, int] | None = None
    #: per group: blocks the remote tier holds, loaded before the local ones
    remote_keys: list[list[bytes]] = field(default_factory=list)
    remote_block_ids: list[list[int]] = field(default_factory=list)

    def all_block_ids(self) -> list[int]:
        local = [b for ids in self.block_ids for b in ids]
        return local + [b for ids in self.remote_block_ids for b in ids]


class _HostSlot(HostBuffer):
    """A buffer one layer is read into, and what still uses it."""

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self.done: Any = None  # the H2D copy still reading this slot
        self.task: Future[None] | None = None  # the read still filling it


class LayerLoader:
    """Loads jobs for one worker; see the module docstring."""

    def __init__(
        self,
        stores: Sequence[KVStore],
        layers: Sequence[LoadLayer],
        backend: Any,
        xfer: Any,
        depth: int,
        remote: RemoteLoads | None = None,
    ) -> None:
        self.remote = remote
        self._stores = list(stores)
        self._layers = list(layers)
        self._backend = backend
        self._xfer = xfer
        self.depth = depth
        self._slots = [_HostSlot(backend) for _ in range(depth)]
        self._host_view = getattr(backend, "host_view", None)  # CPU backend only
        #: per layer, its pages as one writable byte array (host-addressable
        #: KV only), built here: a load slices it. Made per load, each view
        #: cost a ctypes type per new size (12-25 us) and the first one the
        #: lazy import of numpy.ctypeslib (0.8 ms, and a disk read after a
        #: page-cache drop) inside the first hit's start_load_kv.
        self._pages = [self._layer_pages(layer.layout) for layer in self._layers]
        self._readers = ThreadPoolExecutor(
            max_workers=depth,
            thread_name_prefix="npukv-read",
            initializer=backend.bind_thread,
        )
        self._thread: threading.Thread | None = None
        self._queue: list[tuple[LoadJob, bool]] = []  # (job, layer_by_layer)
        self._cond = threading.Condition()
        self._closing = False

    def new_job(
        self, keys: list[list[bytes]], block_ids: list[list[int]], *, gated: bool
    ) -> LoadJob:
        """A job ordered after the compute stream's work so far; ``gated``: a
        layerwise job whose reads follow the forward's wait_layer calls."""
        ready = self._backend.new_event()
        ready.record(self._backend.current_stream())
        layers = len(self._layers)
        return LoadJob(
            keys, block_ids, ready, [None] * layers, [False] * layers,
            consumed=0 if gated else _UNGATED,
        )  # fmt: skip

    def run(self, job: LoadJob, *, layer_by_layer: bool = False) -> None:
        """Load every layer of ``job`` now, on the calling thread.

        Unless ``layer_by_layer``, pages that can be read into in place are
        read for all layers in one call per group and run of blocks: the store
        then verifies each layer while it reads the next ones.
        """
        try:
            if job.remote_block_ids:
                self._load_remote(job)
            if layer_by_layer or not self._read_all_direct(job):
                self._load_layers(job)
        finally:
            with job.cond:
                job.finished = True
                job.ended = time.perf_counter()
                job.cond.notify_all()

    def _load_remote(self, job: LoadJob) -> None:
        """The job's remote blocks, before its local layers: their copies go
        first on the transfer stream, so every layer's event covers them."""
        ids = job.remote_block_ids
        if self.remote is None:
            failed = {b for group in ids for b in group}
        else:
            self._xfer.wait_event(job.ready)
            failed = self.remote.load(job.remote_keys, ids)
        with job.cond:
            job.errors.update(failed)

    def submit(self, job: LoadJob, *, layer_by_layer: bool = True) -> None:
        """Load ``job`` on the loader thread; returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, name="npukv-loader", daemon=True
            )
            self._thread.start()
        with self._cond:
            self._queue.append((job, layer_by_layer))
            self._cond.notify()

    def wait_layer(self, job: LoadJob, index: int) -> None:
        """Make the compute stream wait for layer ``index`` of ``job`` (the
        host waits only for the layer's read to be issued as a copy)."""
        with job.cond:
            job.consumed = max(job.consumed, index)  # layers before are passed
            job.cond.notify_all()
            job.cond.wait_for(lambda: job.done[index] is not None or job.finished)
        done = job.done[index]
        if done is not None:
            self._backend.current_stream().wait_event(done)
            job.waited[index] = True
        with job.cond:
            job.consumed = max(job.consumed, index + 1)
            job.cond.notify_all()

    def settle(self, job: LoadJob) -> None:
        """Wait until ``job`` is finished and its host slots are free."""
        with job.cond:
            job.consumed = _UNGATED  # layers never waited on are read anyway
            job.cond.notify_all()
            job.cond.wait_for(lambda: job.finished)
        for done in job.done:
            if done is not None:
                done.synchronize()

    def complete(self, job: LoadJob) -> bool:
        """Whether ``job`` is finished and its copies have landed (no wait)."""
        return job.finished and all(d is None or d.query() for d in job.done)

    def _main(self) -> None:
        self._backend.bind_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                job, layer_by_layer = self._queue.pop(0)
            try:
                self.run(job, layer_by_layer=layer_by_layer)
            except Exception:
                logger.warning("layer load failed; recomputing", exc_info=True)
                with job.cond:
                    job.errors.update(job.all_block_ids())

    # -- layer by layer ---------------------------------------------------------

    def _load_layers(self, job: LoadJob) -> None:
        self._xfer.wait_event(job.ready)
        tasks = []
        for index, layer in enumerate(self._layers):
            with job.cond:  # the prefetch window: depth layers ahead
                job.cond.wait_for(lambda: index < job.consumed + self.depth)  # noqa: B023
            direct = self._direct_runs(layer.layout, job.block_ids[layer.group])
            if not job.keys[layer.group] or direct is not None:
                tasks.append(
                    self._readers.submit(self._read_layer_direct, job, index, direct)
                )
                continue
            slot = self._slots[index % self.depth]
            if slot.task is not None:
                slot.task.result()  # its previous layer's read has finished
            if slot.done is not None:
                slot.done.synchronize()  # and that layer's H2D too
            slot.done = None
            slot.task = self._readers.submit(self._read_layer, job, index, slot)
            tasks.append(slot.task)
        for task in tasks:
            task.result()

    def _read_layer(self, job: LoadJob, index: int, slot: _HostSlot) -> None:
        """Reader thread: one layer into ``slot``, verified, then its H2D."""
        layer = self._layers[index]
        keys, block_ids = job.keys[layer.group], job.block_ids[layer.group]
        count = len(keys)
        try:
            host = slot.ensure(count * layer.layout.page_bytes)
            rows_out = {layer.tensor: host.reshape(count, -1)}
            ok = self._stores[layer.group].read(keys, rows_out)
            rows = [i for i in range(count) if ok[i]]
            failed = [block_ids[i] for i in range(count) if not ok[i]]
            if rows:
                dev, hst, sizes = build_runs(
                    [layer.layout], [block_ids[i] for i in rows], rows,
                    host.ctypes.data, layer.layout.page_bytes,
                )  # fmt: skip
                with self._backend.stream_ctx(self._xfer):
                    self._backend.copy_runs(hst, dev, sizes, "h2d", self._xfer)
        except Exception:
            logger.warning("layer %d load failed; recomputing", index, exc_info=True)
            failed = list(block_ids)
        done = self._backend.new_event()
        done.record(self._xfer)
        slot.done = done
        self._publish(job, [index], done, failed)

    def _read_layer_direct(
        self, job: LoadJob, index: int, runs: list[tuple[int, int, int]] | None
    ) -> None:
        """Reader thread: one layer straight into its pages (or nothing, when
        its group loads no block this step)."""
        group = self._layers[index].group
        if runs is None:
            done = self._backend.new_event()
            done.record(self._xfer)
            self._publish(job, [index], done, [])
            return
        self._read_direct(job, group, [index], runs)

    def _publish(
        self, job: LoadJob, indices: Sequence[int], done: Any, failed: Sequence[int]
    ) -> None:
        with job.cond:
            job.errors.update(failed)
            for index in indices:
                job.done[index] = done
            job.cond.notify_all()

    # -- straight into the pages (host-addressable KV: the CPU) -----------------

    def _layer_pages(self, layout: LayerLayout) -> np.ndarray | None:
        """All of one layer's pages as a byte array, where they can be read
        into in place (see _direct_runs); None otherwise."""
        if self._host_view is None or len(layout.segments) != 1:
            return None
        (segment,) = layout.segments
        if not segment.block_stride == segment.run_bytes == layout.page_bytes:
            return None
        view: np.ndarray = self._host_view(
            segment.base_ptr, segment.num_blocks * layout.page_bytes
        )
        return view

    def _direct_runs(
        self, layout: LayerLayout, block_ids: list[int]
    ) -> list[tuple[int, int, int]] | None:
        """``(first row, rows, step)`` of the job's runs of block ids that go up
        (step 1) or down (step -1) by one, when the pages can be read into in
        place: host-addressable memory, one run per block, blocks adjacent.
        None otherwise, or when the runs are so short that one read into a
        slot plus one copy is cheaper; a single run never is (one read per
        layer either way, and in place no copy follows), so a short hit of
        adjacent blocks takes the same path as a long one. (vLLM hands a
        request the blocks another one freed, often in descending order.)"""
        if self._host_view is None or len(layout.segments) != 1 or not block_ids:
            return None
        (segment,) = layout.segments
        if not segment.block_stride == segment.run_bytes == layout.page_bytes:
            return None
        runs: list[tuple[int, int, int]] = []
        for row, block in enumerate(block_ids):
            if runs:
                first, count, step = runs[-1]
                gap = block - block_ids[row - 1]
                if gap in (1, -1) and (count == 1 or gap == step):
                    runs[-1] = (first, count + 1, gap)
                    continue
            runs.append((row, 1, 1))
        return runs if len(runs) == 1 or len(runs) * 4 <= len(block_ids) else None

    def _read_all_direct(self, job: LoadJob) -> bool:
        """Read every layer in place, one store call per group and run of
        blocks; False (nothing done) when some layer cannot be read in place."""
        by_group: dict[int, tuple[list[tuple[int, int, int]], list[int]]] = {}
        for index, layer in enumerate(self._layers):
            block_ids = job.block_ids[layer.group]
            if not block_ids:
                continue
            runs = self._direct_runs(layer.layout, block_ids)
            if runs is None:
                return False
            by_group.setdefault(layer.group, (runs, []))[1].append(index)
        if not by_group:
            return False
        for group, (runs, indices) in by_group.items():
            self._read_direct(job, group, indices, runs)
        idle = [i for i, done in enumerate(job.done) if done is None]
        if idle:  # layers of groups that load nothing this step
            done = self._backend.new_event()
            done.record(self._xfer)
            self._publish(job, idle, done, [])
        return True

    def _read_direct(
        self,
        job: LoadJob,
        group: int,
        indices: Sequence[int],
        runs: list[tuple[int, int, int]],
    ) -> None:
        """Read layers ``indices`` (all of ``group``) from disk straight into
        the KV pages, all runs of blocks in one store call (each chunk file is
        then read once, in file order; the store verifies each layer while it
        reads the next). A row that fails leaves its page unspecified; it is
        reported and recomputed."""
        keys, block_ids = job.keys[group], job.block_ids[group]
        requests = []
        run_rows = []
        for first, count, step in runs:
            # rows in memory order: a descending run is read with its keys
            # reversed, so row i of the pages is still key i of the request
            rows = range(first, first + count)[::step]
            low_block = block_ids[rows[0]]
            out = {}
            for index in indices:
                layer, layer_pages = self._layers[index], self._pages[index]
                assert layer_pages is not None  # _direct_runs said in place
                page = layer.layout.page_bytes
                pages = layer_pages[low_block * page : (low_block + count) * page]
                out[layer.tensor] = pages.reshape(count, page)
            requests.append(([keys[row] for row in rows], out))
            run_rows.append(rows)
        failed: list[int] = []
        try:
            results = self._stores[group].read_many(requests)
        except Exception:
            logger.warning("direct load failed; recomputing", exc_info=True)
            results = [[False] * len(rows) for rows in run_rows]
        for rows, ok in zip(run_rows, results, strict=True):
            failed += [block_ids[r] for r, hit in zip(rows, ok, strict=True) if not hit]
        done = self._backend.new_event()
        done.record(self._xfer)
        self._publish(job, indices, done, failed)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._readers.shutdown(wait=True)
        for slot in self._slots:
            slot.close()
        if self.remote is not None:
            self.remote.close()
