"""put_async's machinery: the staging ring, the background writer and its engine.

Runs in: the process of one KVStore handle; ``stage()`` on the caller's thread
(the producer), ``_publish``/``_discard`` on the writer thread.

    stage()  - reserve a region, lay the batch out as its chunk file, submit
    flush()  - wait until everything staged so far is published
    close()  - drain complete batches, drop incomplete ones, unlink the ring

The producer's cost is one reserve, one header encode and one native batched
copy of the blocks' bytes into the ring (GIL released, threads above 4 MiB);
checksums, the disk write, fsync, rename and the index commit all happen on the
writer thread.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from npukv_store import native
from npukv_store.config import StoreConfig
from npukv_store.io.direct import align_up
from npukv_store.io.engine import IOEngine, make_engine
from npukv_store.io.ring import StagingRing
from npukv_store.io.writer import BackgroundWriter, Event, SaveBatch
from npukv_store.spec import NamespaceSpec
from npukv_store.store.chunk_writer import publish_image
from npukv_store.store.directory import HOST
from npukv_store.store.format import encode_header, layer_checksums

if TYPE_CHECKING:
    from npukv_store.store.store import KVStore


class StagedBatch:
    """A reserved ring region laid out as one chunk file, being filled.

    The data section is layer-major: layer ``i``'s rows start at
    :meth:`layer_offset` and each row is that layer's ``row_bytes``, parts
    one after the other (see docs/format.md).
    """

    __slots__ = ("batch", "data_start")

    def __init__(self, batch: SaveBatch, data_start: int) -> None:
        self.batch = batch
        self.data_start = data_start

    @property
    def image(self) -> np.ndarray:
        return self.batch.image

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.batch.keys

    def layer_offset(self, spec: NamespaceSpec, layer_index: int) -> int:
        """Byte offset in :attr:`image` of layer ``layer_index``'s first row."""
        count = len(self.batch.keys)
        before = sum(layer.row_bytes for layer in spec.layers[:layer_index])
        return self.data_start + count * before


class AsyncSaver:
    """The asynchronous save path of one store handle and its siblings (other
    namespaces of the same process, see :meth:`KVStore.sibling`): one ring and
    one writer thread, each batch published by the handle that reserved it."""

    def __init__(self, config: StoreConfig, ring_dir: str = "/dev/shm") -> None:
        self.ring = StagingRing(config.ring_size, directory=ring_dir)
        self._engine: IOEngine | None = None  # created and used by the writer thread
        self.writer = BackgroundWriter(self.ring, self._publish, self._discard)

    def stage(
        self,
        store: KVStore,
        keys: Sequence[bytes],
        rows: dict[str, np.ndarray],
        fresh: list[int],
        event: Event | None,
    ) -> int:
        """Stage the ``fresh`` rows of ``store``'s namespace; returns how many
        were queued (0: dropped)."""
        if not fresh:
            return 0
        staged = self.reserve(store, tuple(keys[i] for i in fresh))
        if staged is None:
            return 0  # ring full: drop the batch, never wait
        spec = store.spec
        native.copy_runs(
            [rows[name] for name in spec.tensor_names()],
            [staged.image],
            _gather_runs(spec, staged.data_start, fresh, len(fresh) == len(keys)),
        )
        self.submit(staged, event)
        return len(fresh)

    def reserve(
        self, store: KVStore, batch_keys: tuple[bytes, ...]
    ) -> StagedBatch | None:
        """A ring region laid out as the chunk of ``batch_keys`` in ``store``'s
        namespace, with its header written; the caller fills the data section.
        None when the ring is full."""
        spec = store.spec
        created = time.time_ns()
        header = encode_header(
            spec,
            store.namespace,
            batch_keys,
            creator=f"{os.getpid()}@{HOST}",
            created_ns=created,
        )
        count = len(batch_keys)
        file_bytes = len(header) + count * (spec.block_bytes + 8 * len(spec.layers))
        region = self.ring.reserve(file_bytes)
        if region is None:
            return None
        image = self.ring.view(region)[:file_bytes]
        image[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        return StagedBatch(
            SaveBatch(
                region,
                image,
                batch_keys,
                secrets.randbits(63) + 1,
                created,
                owner=store,
            ),  # fmt: skip
            len(header),
        )

    def submit(self, staged: StagedBatch, event: Event | None) -> None:
        """Hand a filled batch to the writer (after ``event`` fires)."""
        staged.batch.event = event
        self.writer.submit(staged.batch)

    def abort(self, staged: StagedBatch) -> None:
        """Give a reserved batch's region back unwritten."""
        self.ring.release(staged.batch.region)

    def _publish(self, batch: SaveBatch) -> None:
        """Writer thread: checksums into the image, write, publish, release keys."""
        store = _owner(batch)
        try:
            if self._engine is None:
                self._engine = make_engine(
                    store.config.io_engine, store.config.io_queue_depth
                )
                # Pinned once: the writer's O_DIRECT writes all come from the
                # ring, and pinning its 4 KiB shmem pages per request costs
                # about 13% of the write time (docs/design.md §12).
                self._engine.register_buffer(self.ring.data.data)
            padded = None
            if store.config.direct_io:  # regions are page-aligned and padded
                padded = self.ring.view(batch.region)[: align_up(batch.image.size)]
            path, size = publish_image(
                store.dir,
                store.namespace,
                batch.chunk_id,
                batch.image,
                self._engine,
                sync=store.config.fsync == "chunk",
                padded=padded,
                tail_offset=self._table_offset(batch),
                fill_tail=lambda: self._fill_checksums(batch),
            )
            store._commit(batch.chunk_id, batch.keys, path, size, batch.created_ns, 0)
        finally:
            store._release_claims(batch.keys)

    def _table_offset(self, batch: SaveBatch) -> int:
        """Offset of the checksum table: everything before it is final."""
        return batch.image.size - 8 * len(batch.keys) * len(_owner(batch).spec.layers)

    def _fill_checksums(self, batch: SaveBatch) -> None:
        """Runs while the data section's first writes are at the disk."""
        spec = _owner(batch).spec
        count = len(batch.keys)
        sums = np.empty((count, len(spec.layers)), dtype="<u8")
        offset = self._table_offset(batch) - count * spec.block_bytes
        for col, layer in enumerate(spec.layers):
            parts = []
            for part in layer.parts:
                parts.append(batch.image[offset : offset + count * part.row_bytes])
                offset += count * part.row_bytes
            sums[:, col] = layer_checksums(parts, count)
        batch.image[offset:] = sums.view(np.uint8).reshape(-1)

    def _discard(self, batch: SaveBatch) -> None:
        store = _owner(batch)
        store.counters.add(failed_batches=1)
        store._release_claims(batch.keys)

    def flush(self, timeout_s: float | None = None) -> bool:
        return self.writer.flush(timeout_s)

    def close(self) -> None:
        """Drain, stop the writer, release its engine and unlink the ring."""
        self.writer.close()
        if self._engine is not None:
            self._engine.close()
        self.ring.close()


def _owner(batch: SaveBatch) -> KVStore:
    store = batch.owner
    assert store is not None, "every batch is reserved for a store handle"
    return store  # type: ignore[return-value]


def _gather_runs(
    spec: NamespaceSpec, data_start: int, fresh: list[int], whole: bool
) -> np.ndarray:
    """copy_runs rows ``(src tensor, src offset, 0, dst offset, nbytes)`` that lay
    the ``fresh`` rows of every tensor out layer-major after the header: one run
    per tensor when every row is taken, else one per row."""
    sizes = [part.row_bytes for layer in spec.layers for part in layer.parts]
    count = len(fresh)
    runs = []
    offset = data_start
    for index, row_bytes in enumerate(sizes):
        if whole:
            runs.append((index, 0, 0, offset, count * row_bytes))
        else:
            runs += [
                (index, row * row_bytes, 0, offset + slot * row_bytes, row_bytes)
                for slot, row in enumerate(fresh)
            ]
        offset += count * row_bytes
    return np.array(runs, dtype=np.int64).reshape(-1, 5)
