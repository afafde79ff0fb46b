"""Loads from the remote tier: Mooncake values -> a host buffer -> KV pages.

Runs in: the worker process, on whichever thread runs the load job (the
forward thread in bulk mode, the loader thread otherwise), before the job's
local layers are read.

Per KV cache group, one ``batch_get_into`` reads every remote block of the job
into one registered host buffer (``[blocks, value_bytes]``); the tier checks
each value (its MAC, namespace, key, every layer's checksum) and what fails
is a load error, recomputed by vLLM. Then each layer's rows are copied to its pages
through the device layer, on the transfer stream, before any local layer of
the job is issued: every layer's "done" event, recorded later on the same
stream, covers them. With ``remote_promote`` the verified blocks are also
staged into the local store (not written back to the tier), so the next hit
on them is local; that copy runs on its own thread, after the pages are
filled, and the next load waits for it before reusing the buffer.

A get abandoned at its deadline may still write into its buffer: that buffer
is set aside until the call returns, then freed. At most MAX_ABANDONED are
set aside; while that many are, remote blocks are recomputed without asking
the tier (which itself sends nothing while such a get is out).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from npukv_store import native
from npukv_store.connector.worker.block_runs import build_runs
from npukv_store.connector.worker.host_buffer import HostBuffer
from npukv_store.remote.tier import MooncakeTier
from npukv_store.remote.value import ValueLayout
from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)

#: buffers a hung get may still write into, kept until it returns; a load
#: can be GBs, so a peer that never answers must not make each load leak one
MAX_ABANDONED = 1


class _Buffer(HostBuffer):
    """The load buffer: registered with the tier too, and touched when made
    (page faults inside a get would count against its deadline and the
    TTFT)."""

    def __init__(self, tier: MooncakeTier, backend: Any) -> None:
        super().__init__(backend)
        self._tier = tier

    def _registered(self, view: np.ndarray) -> None:
        view.fill(0)
        self._tier.register(view.ctypes.data, view.nbytes)

    def _unregistering(self, view: np.ndarray) -> None:
        self._tier.unregister(view.ctypes.data)


class RemoteLoads:
    """The remote part of load jobs, for one worker (see the module docstring).

    Args:
        layers: per loaded layer, ``(group, position in its group's spec,
            its LayerLayout)``.
    """

    def __init__(
        self,
        tier: MooncakeTier,
        stores: Sequence[KVStore],
        layers: Sequence[tuple[int, int, Any]],
        backend: Any,
        xfer: Any,
        promote: bool,
    ) -> None:
        self.tier = tier
        self._stores = list(stores)
        self._layers = list(layers)
        self._backend = backend
        self._xfer = xfer
        self._promote = promote
        self._value_layouts = [ValueLayout.for_spec(s.spec) for s in self._stores]
        self._buffer = _Buffer(tier, backend)
        # (buffer, its get): set aside until the get returns
        self._abandoned: list[tuple[_Buffer, Future[Any]]] = []
        self._promoter = ThreadPoolExecutor(1, thread_name_prefix="npukv-promote")
        self._promoting: Future[None] | None = None

    def load(
        self, keys: Sequence[Sequence[bytes]], block_ids: Sequence[list[int]]
    ) -> set[int]:
        """Load every group's remote blocks (``keys[g]`` into ``block_ids[g]``);
        returns the block ids that failed (to recompute)."""
        failed: set[int] = set()
        for group, (group_keys, ids) in enumerate(zip(keys, block_ids, strict=True)):
            if group_keys:
                failed.update(self._load_group(group, list(group_keys), ids))
        return failed

    def _load_group(self, group: int, keys: list[bytes], ids: list[int]) -> list[int]:
        store = self._stores[group]
        layout = self._value_layouts[group]
        count = len(keys)
        self._wait_promotion()  # it reads the buffer about to be reused
        if self._free_abandoned() >= MAX_ABANDONED:
            return list(ids)  # recomputed; the tier is down until it returns
        try:
            host = self._buffer.ensure(count * layout.value_bytes).reshape(count, -1)
            result = self.tier.fetch(store.fingerprint, layout, keys, host)
        except Exception:
            logger.warning(
                "npukv_store: remote load failed; recomputing", exc_info=True
            )
            return list(ids)
        if result.abandoned:  # the call may still write into it: keep it
            # alive, unused, until the call returns (result.pending)
            pending = result.pending
            if pending is None or not pending.done():
                self._abandoned.append((self._buffer, pending or _never()))
                self._buffer = _Buffer(self.tier, self._backend)
            return list(ids)
        rows = [i for i in range(count) if result.ok[i]]
        if rows:
            try:
                self._copy(group, layout, host, rows, ids)
            except Exception:
                logger.warning(
                    "npukv_store: remote copy failed; recomputing", exc_info=True
                )
                return list(ids)
            if self._promote:
                self._promoting = self._promoter.submit(
                    self._promote_rows, store, layout, host,
                    [keys[i] for i in rows], rows,
                )  # fmt: skip
        return [ids[i] for i in range(count) if not result.ok[i]]

    def _copy(
        self,
        group: int,
        layout: ValueLayout,
        host: np.ndarray,
        rows: list[int],
        ids: list[int],
    ) -> None:
        """Each layer's rows of ``host`` into its pages, then wait: the buffer
        is reused by the next load."""
        base = host.ctypes.data
        targets = [ids[i] for i in rows]
        with self._backend.stream_ctx(self._xfer):
            for layer_group, position, page_layout in self._layers:
                if layer_group != group:
                    continue
                dev, hst, sizes = build_runs(
                    [page_layout], targets, rows,
                    base + layout.layer_offset(position), layout.value_bytes,
                )  # fmt: skip
                self._backend.copy_runs(hst, dev, sizes, "h2d", self._xfer)
        done = self._backend.new_event()
        done.record(self._xfer)
        done.synchronize()

    def _promote_rows(
        self,
        store: KVStore,
        layout: ValueLayout,
        host: np.ndarray,
        keys: list[bytes],
        rows: list[int],
    ) -> None:
        """Stage verified remote blocks into the local store, on the promotion
        thread (off the load: the next load waits for it before reusing the
        buffer). Best effort: a full ring or a claimed key skips them."""
        try:
            staged = store.begin_save(keys, to_remote=False)
            if staged is None:
                return
            chunk = staged.batch.layout
            base, size = host.ctypes.data, layout.value_bytes
            image = staged.image.ctypes.data + chunk.data_start
            src, dst, sizes = [], [], []
            offset = layout.header_bytes
            for part in chunk.parts():  # file order: the value's order too
                for slot, index in enumerate(staged.indices):
                    src.append(base + rows[index] * size + offset)
                    dst.append(image + part.begin + slot * part.row_bytes)
                    sizes.append(part.row_bytes)
                offset += part.row_bytes
            native.copy_ptrs(
                np.array(src, np.int64), np.array(dst, np.int64),
                np.array(sizes, np.int64),
            )  # fmt: skip
            store.commit_save(staged)
        except Exception:
            logger.warning("npukv_store: promoting remote blocks failed", exc_info=True)

    def _free_abandoned(self) -> int:
        """Free the set-aside buffers whose get has returned; how many are
        still written by a call out."""
        still = []
        for buffer, pending in self._abandoned:
            if pending.done():
                buffer.close()
            else:
                still.append((buffer, pending))
        self._abandoned = still
        return len(still)

    def _wait_promotion(self) -> None:
        pending, self._promoting = self._promoting, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self._wait_promotion()
        self._promoter.shutdown(wait=True)
        self._buffer.close()
        self._free_abandoned()  # the rest the process's exit frees


def _never() -> Future[Any]:
    """A future that never completes: a buffer abandoned without one is
    never known to be free, so it is never reused (nor freed)."""
    return Future()
