"""One worker's saves of a step: KV pages -> the staging ring, layer by layer.

Runs in: the worker process, on the forward thread (the layer hooks and
wait_for_save); the store's writer thread then writes and publishes.

    plan()        - a new step's saves (nothing claimed yet)
    copy_layer()  - claim the step's blocks and reserve their ring regions
                    (once), then D2H of one layer into every batch of its group
    finish()      - copy the layers no hook copied, queue the batches; returns
                    what was queued
    fence()       - the D2H copies out of blocks about to be reused are done

A step's blocks are claimed per KV cache group in chunks of about
``chunk_target_size``; a full ring drops the batch (counted by the store),
and any fault aborts the step's batches: nothing half-filled is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.connector.metadata import (
    BlockTransfer,
    concat_transfers,
    slice_parents,
)
from npukv_store.connector.worker.block_runs import build_runs
from npukv_store.connector.worker.loader import LoadLayer
from npukv_store.device.ordering import d2h_after, record_written
from npukv_store.spec import NamespaceSpec
from npukv_store.store.sizing import blocks_per_chunk
from npukv_store.store.store import KVStore
from npukv_store.store.write.staging import StagedSave


class StepSaver:
    """The save half of a WorkerSide; see the module docstring."""

    def __init__(
        self,
        stores: Sequence[KVStore],
        specs: Sequence[NamespaceSpec],
        layers: Sequence[LoadLayer],
        layer_pos: Sequence[int],
        backend: Any,
        xfer: Any,
        settings: StoreConfig,
        rank: int,
        warn_once: Callable[[str, str], None],
        *,
        state_groups: Collection[int] = (),
    ) -> None:
        self._stores, self._specs = stores, specs
        self._layers, self._layer_pos = layers, layer_pos
        self._backend, self._xfer = backend, xfer
        self._settings, self._rank = settings, rank
        self._warn_once = warn_once
        self._state_groups = frozenset(state_groups)
        self._saves: list[BlockTransfer] = []
        self._staged: list[tuple[StagedSave, list[int], int]] = []  # +ids, group
        self._filled = [False] * len(layers)
        self._started = 0.0
        self._last_event: Any = None

    def plan(self, saves: list[BlockTransfer]) -> None:
        self._saves = saves
        self._staged = []
        self._filled = [False] * len(self._layers)

    def copy_layer(self, index: int) -> None:
        """The layer hook: copy layer ``index`` out now (once per step)."""
        if not self._saves or self._filled[index]:
            return
        try:
            self._claim()
            self._copy_out(index)
        except Exception:
            self._abort("layerwise save")

    def finish(self) -> tuple[int, int, float] | None:
        """wait_for_save: ``(blocks, bytes, seconds)`` queued, or None."""
        if not self._saves:
            return None
        try:
            self._claim()
            for index, filled in enumerate(self._filled):
                if not filled and self._staged:
                    self._copy_out(index)
            return self._commit()
        except Exception:
            self._abort("save")
            return None
        finally:
            self._saves = []

    def fence(self) -> None:
        """handle_preemptions / held requests: the D2H copies out of blocks
        about to be reused must be complete."""
        if self._last_event is not None:
            self._last_event.synchronize()
            self._last_event = None

    def _claim(self) -> None:
        """Claim this step's blocks and reserve their ring regions (once)."""
        if self._staged or not self._saves:
            return
        self._started = time.perf_counter()
        # a chunk holds one tenant's blocks (docs/decisions/0067)
        batches = sorted({(s.group, s.tenant) for s in self._saves})
        for group, tenant in batches:
            transfers = [
                s for s in self._saves if (s.group, s.tenant) == (group, tenant)
            ]
            keys, block_ids = concat_transfers(transfers, self._rank)
            # each chunk goes below its chains' parents in the LRU (0070);
            # saves that are not chains (sliding tails, states) name none
            chained = all(s.parents_by_rank for s in transfers)
            parents = [p for s in transfers for p in s.row_parents(self._rank)]
            per_chunk = blocks_per_chunk(
                self._specs[group].block_bytes, self._settings.chunk_target_size
            )
            for start in range(0, len(keys), per_chunk):
                stop = start + per_chunk
                staged = self._stores[group].begin_save(
                    keys[start:stop], tenant=tenant,
                    parent=slice_parents(keys, parents, start, min(stop, len(keys)))
                    if chained
                    else None,
                )  # fmt: skip
                if staged is not None:
                    ids = [block_ids[start + i] for i in staged.indices]
                    self._staged.append((staged, ids, group))
        if not self._staged:
            self._saves = []  # all stored, in flight or dropped

    def _copy_out(self, index: int) -> None:
        """D2H of layer ``index``'s blocks into every staged batch of its
        group, ordered after the compute stream's work so far (the layer's KV
        is written)."""
        layer = self._layers[index]
        written = record_written(self._backend)
        for staged, block_ids, group in self._staged:
            if group != layer.group:
                continue
            src, dst, sizes = build_runs(
                [layer.layout], block_ids, range(len(block_ids)),
                staged.layer_address(self._layer_pos[index]), layer.layout.page_bytes,
            )  # fmt: skip
            with self._backend.stream_ctx(self._xfer):
                d2h_after(self._backend, written, self._xfer, src, dst, sizes)
        self._filled[index] = True

    def _commit(self) -> tuple[int, int, float] | None:
        if not self._staged:
            return None
        done = self._backend.new_event()
        done.record(self._xfer)
        blocks = nbytes = 0
        for staged, _, group in self._staged:
            self._stores[group].commit_save(staged, done)
            blocks += len(staged.keys)
            nbytes += len(staged.keys) * self._specs[group].block_bytes
        if any(group in self._state_groups for _, _, group in self._staged):
            # vLLM may free a handed-over Mamba block in the next step (its
            # interior states are nulled) and hand it to another request,
            # whose forward would overwrite it while the D2H still reads it:
            # the compute stream waits for the copies (on the device, no host
            # sync; a no-op where copies are synchronous)
            self._backend.current_stream().wait_event(done)
        self._staged = []
        self._last_event = done
        return blocks, nbytes, time.perf_counter() - self._started

    def _abort(self, what: str) -> None:
        self._warn_once(what, f"{what} failed; this step's blocks are not saved")
        for staged, _, group in self._staged:
            self._stores[group].abort_save(staged)
        self._staged = []
        self._saves = []
