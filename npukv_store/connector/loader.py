"""Layer-by-layer loads: store -> registered host slots -> device pages.

Runs in: the worker process. ``run`` on the forward thread (bulk mode) or on
the loader thread (layerwise mode, ``submit``); ``wait_layer``/``settle`` on
the forward thread.

One job per step holds every block loaded in that step. Layers are read in
order, each into one of ``prefetch_depth`` host slots, then copied to the
device on the transfer stream; a slot is reused once its previous H2D copy has
completed, so reads run up to ``prefetch_depth`` layers ahead of the copies the
compute stream waits on. The transfer stream first waits on an event the
compute stream recorded when the job was created: destination blocks may still
be being zeroed (DEVICE.md §1.3). That event, not ``wait_stream``, because a
``wait_stream`` issued later from the loader thread would also wait for the
attention work enqueued meanwhile and serialise loads behind compute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npukv_store.connector.namespace import PAGE_PART
from npukv_store.layout import LayerLayout, build_runs
from npukv_store.spec import NamespaceSpec
from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)

_HOST_ALIGN = 4096


@dataclass
class LoadJob:
    """One step's loads, all requests together."""

    keys: list[bytes]
    block_ids: list[int]
    ready: Any  # event on the compute stream: destinations may be written
    done: list[Any]  # per layer: the H2D copy's event, None until issued
    waited: list[bool]  # per layer: the compute stream was made to wait on it
    errors: set[int] = field(default_factory=set)  # block ids not loaded
    finished: bool = False
    started: float = field(default_factory=time.perf_counter)
    cond: threading.Condition = field(default_factory=threading.Condition)


class _HostSlot:
    """A grow-only, device-registered host buffer that one layer is read into."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._raw = np.empty(0, dtype=np.uint8)
        self.view = self._raw
        self._region: Any = None
        self.done: Any = None  # the H2D copy still reading this slot

    def ensure(self, nbytes: int) -> np.ndarray:
        if self.view.size < nbytes:
            self.close()
            self._raw = np.empty(nbytes + _HOST_ALIGN, dtype=np.uint8)
            skip = -self._raw.ctypes.data % _HOST_ALIGN
            self.view = self._raw[skip : skip + nbytes]
            self._region = self._backend.register_host(self.view.ctypes.data, nbytes)
        return self.view[:nbytes]

    def close(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None


class LayerLoader:
    """Loads jobs for one worker; see the module docstring."""

    def __init__(
        self,
        store: KVStore,
        spec: NamespaceSpec,
        layouts: list[LayerLayout],
        backend: Any,
        xfer: Any,
        depth: int,
    ) -> None:
        self._store = store
        self._names = [f"{layer.name}.{PAGE_PART}" for layer in spec.layers]
        self._layouts = layouts
        self._backend = backend
        self._xfer = xfer
        self._slots = [_HostSlot(backend) for _ in range(depth)]
        self._host_view = getattr(backend, "host_view", None)  # CPU backend only
        self._thread: threading.Thread | None = None
        self._queue: list[LoadJob] = []
        self._cond = threading.Condition()
        self._closing = False

    def new_job(self, keys: list[bytes], block_ids: list[int]) -> LoadJob:
        """A job ordered after the compute stream's work so far."""
        ready = self._backend.new_event()
        ready.record(self._backend.current_stream())
        layers = len(self._layouts)
        return LoadJob(keys, block_ids, ready, [None] * layers, [False] * layers)

    def run(self, job: LoadJob, *, layer_by_layer: bool = False) -> None:
        """Load every layer of ``job`` now, on the calling thread.

        Unless ``layer_by_layer``, pages that can be read into in place are
        read for all layers in one call per run of blocks: the store then
        verifies each layer while it reads the next ones.
        """
        try:
            if layer_by_layer or not self._read_all_direct(job):
                self._load_layers(job)
        finally:
            with job.cond:
                job.finished = True
                job.cond.notify_all()

    def submit(self, job: LoadJob) -> None:
        """Load ``job`` on the loader thread; returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._main, name="npukv-loader", daemon=True
            )
            self._thread.start()
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    def wait_layer(self, job: LoadJob, index: int) -> None:
        """Make the compute stream wait for layer ``index`` of ``job`` (the
        host waits only for the layer's read to be issued as a copy)."""
        with job.cond:
            job.cond.wait_for(lambda: job.done[index] is not None or job.finished)
        done = job.done[index]
        if done is not None:
            self._backend.current_stream().wait_event(done)
            job.waited[index] = True

    def settle(self, job: LoadJob) -> None:
        """Wait until ``job`` is finished and its host slots are free."""
        with job.cond:
            job.cond.wait_for(lambda: job.finished)
        for done in job.done:
            if done is not None:
                done.synchronize()

    def _main(self) -> None:
        self._backend.bind_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                job = self._queue.pop(0)
            try:
                self.run(job, layer_by_layer=True)
            except Exception:
                logger.warning("layer load failed; recomputing", exc_info=True)
                job.errors.update(job.block_ids)

    def _load_layers(self, job: LoadJob) -> None:
        self._xfer.wait_event(job.ready)
        count = len(job.keys)
        for index, layout in enumerate(self._layouts):
            direct = self._direct_runs(layout, job.block_ids)
            if direct is not None:
                self._read_direct(job, [index], direct)
                continue
            slot = self._slots[index % len(self._slots)]
            if slot.done is not None:
                slot.done.synchronize()  # its previous layer's H2D has finished
            host = slot.ensure(count * layout.page_bytes)
            rows_out = {self._names[index]: host.reshape(count, -1)}
            ok = self._store.read(job.keys, rows_out)
            rows = [i for i in range(count) if ok[i]]
            job.errors.update(job.block_ids[i] for i in range(count) if not ok[i])
            if rows:
                dev, hst, sizes = build_runs(
                    [layout], [job.block_ids[i] for i in rows], rows,
                    host.ctypes.data, layout.page_bytes,
                )  # fmt: skip
                with self._backend.stream_ctx(self._xfer):
                    self._backend.copy_runs(hst, dev, sizes, "h2d", self._xfer)
            done = self._backend.new_event()
            done.record(self._xfer)
            slot.done = done
            with job.cond:
                job.done[index] = done
                job.cond.notify_all()

    def _direct_runs(
        self, layout: LayerLayout, block_ids: list[int]
    ) -> list[tuple[int, int, int]] | None:
        """``(first row, rows, step)`` of the job's runs of block ids that go up
        (step 1) or down (step -1) by one, when the pages can be read into in
        place: host-addressable memory, one run per block, blocks adjacent.
        None otherwise, or when the runs are so short that one read into a
        slot plus one copy is cheaper. (vLLM hands a request the blocks another
        one freed, often in descending order.)"""
        if self._host_view is None or len(layout.segments) != 1:
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
        return runs if len(runs) * 4 <= len(block_ids) else None

    def _read_all_direct(self, job: LoadJob) -> bool:
        """Read every layer in place, one store call per run of blocks;
        False (nothing done) when some layer cannot be read in place."""
        plans = [self._direct_runs(layout, job.block_ids) for layout in self._layouts]
        if not plans or any(p is None for p in plans):
            return False
        runs = plans[0]
        assert runs is not None  # the same block ids give the same runs
        self._read_direct(job, range(len(self._layouts)), runs)
        return True

    def _read_direct(
        self, job: LoadJob, indices: Sequence[int], runs: list[tuple[int, int, int]]
    ) -> None:
        """Read layers ``indices`` from disk straight into the KV pages, all
        runs of blocks in one store call (each chunk file is then read once,
        in file order; the store verifies each layer while it reads the next).
        A row that fails leaves its page unspecified; it is reported and
        recomputed."""
        assert self._host_view is not None
        requests = []
        run_rows = []
        for first, count, step in runs:
            # rows in memory order: a descending run is read with its keys
            # reversed, so row i of the pages is still key i of the request
            rows = range(first, first + count)[::step]
            low_block = job.block_ids[rows[0]]
            out = {}
            for index in indices:
                layout = self._layouts[index]
                (segment,) = layout.segments
                address = segment.base_ptr + low_block * segment.block_stride
                pages = self._host_view(address, count * layout.page_bytes)
                out[self._names[index]] = pages.reshape(count, layout.page_bytes)
            requests.append(([job.keys[row] for row in rows], out))
            run_rows.append(rows)
        for rows, ok in zip(run_rows, self._store.read_many(requests), strict=True):
            job.errors.update(
                job.block_ids[row] for row, hit in zip(rows, ok, strict=True) if not hit
            )
        done = self._backend.new_event()
        done.record(self._xfer)
        with job.cond:
            for index in indices:
                job.done[index] = done
            job.cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for slot in self._slots:
            slot.close()
