"""put_async's machinery: the staging ring, the background writer and its engine.

Runs in: the process of one KVStore handle; ``stage()`` on the caller's thread
(the producer), ``_publish``/``_discard`` on the writer thread.

    stage()  - reserve a region, lay the batch out as its chunk file, submit
    flush()  - wait until everything staged so far is published
    close()  - drain complete batches, drop incomplete ones, unlink the ring
    StagedSave - a reserved region a caller fills layer by layer
                 (``KVStore.begin_save``: the connector's device copies)

The producer's cost is one reserve, one header encode and one native batched
copy of the blocks' bytes into the ring (GIL released, threads above 4 MiB);
checksums, the disk write, fsync, rename and the index commit all happen on the
writer thread.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from npukv_store import native
from npukv_store.config import StoreConfig
from npukv_store.io.direct import align_up
from npukv_store.io.engine import IOEngine, make_engine
from npukv_store.io.ring_sizing import RingRequest, open_ring
from npukv_store.io.writer import BackgroundWriter, Event, SaveBatch
from npukv_store.keying import DEFAULT_TENANT
from npukv_store.spec import NamespaceSpec
from npukv_store.store.directory import HOST
from npukv_store.store.format import ChunkLayout, encode_header, layer_checksums
from npukv_store.store.index_rows import ChunkRecord
from npukv_store.store.publish import Publisher
from npukv_store.store.touches import TouchRecorder
from npukv_store.store.write.chunk_file import publish_image

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveTarget:
    """Where a batch goes: what the writer thread needs to publish it. One ring
    carries the batches of several namespaces (a hybrid model's KV cache
    groups), so each batch names its own."""

    publisher: Publisher
    spec: NamespaceSpec
    fingerprint: bytes
    touches: TouchRecorder

    @property
    def namespace(self) -> str:
        return self.fingerprint.hex()


class RemoteSink(Protocol):
    """The tier behind the store (npukv_store.remote's MooncakeTier): takes
    published blocks straight from their ring region."""

    def offer_blocks(
        self,
        spec: NamespaceSpec,
        fingerprint: bytes,
        keys: Sequence[bytes],
        pieces: list[list[tuple[int, int]]],
        release: Callable[[], None],
    ) -> bool: ...

    def drain(self, timeout_s: float) -> bool: ...


#: how long close waits for remote puts still reading the ring
_REMOTE_DRAIN_S = 10.0


class StagedBatch:
    """A reserved ring region laid out as one chunk file (``layout``), being
    filled: layer ``i``'s rows start at ``layout.layer_offset(i)`` (see
    docs/format.md)."""

    __slots__ = ("batch", "layout")

    def __init__(self, batch: SaveBatch, layout: ChunkLayout) -> None:
        self.batch = batch
        self.layout = layout

    @property
    def image(self) -> np.ndarray:
        return self.batch.image

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.batch.keys

    @property
    def data_start(self) -> int:
        return self.layout.data_start


class AsyncSaver:
    """The asynchronous save path of one store handle and its siblings (other
    namespaces of the same process, see :meth:`KVStore.sibling`): one ring and
    one writer thread, each batch published through its own :class:`SaveTarget`."""

    def __init__(
        self,
        config: StoreConfig,
        ring_dir: str = "/dev/shm",
        ring_request: RingRequest | None = None,
    ) -> None:
        self.config = config
        self.ring = open_ring(config.ring_size, ring_request, directory=ring_dir)
        self._engine: IOEngine | None = None  # created and used by the writer thread
        self.writer = BackgroundWriter(self.ring, self._publish, self._discard)
        #: where published blocks are also written (write-through,
        #: docs/decisions/0055); set by the connector
        self.remote: RemoteSink | None = None

    def stage(
        self,
        target: SaveTarget,
        keys: Sequence[bytes],
        rows: dict[str, np.ndarray],
        fresh: list[int],
        event: Event | None,
        tenant: bytes = DEFAULT_TENANT,
        *,
        parents: tuple[bytes, ...] = (),
    ) -> int:
        """Stage the ``fresh`` rows for ``target``; returns how many were
        queued (0: dropped)."""
        if not fresh:
            return 0
        staged = self.reserve(
            target, tuple(keys[i] for i in fresh), tenant=tenant, parents=parents
        )
        if staged is None:
            return 0  # ring full: drop the batch, never wait
        spec = target.spec
        native.copy_runs(
            [rows[name] for name in spec.tensor_names()],
            [staged.image],
            _gather_runs(spec, staged.data_start, fresh, len(fresh) == len(keys)),
        )
        self.submit(staged, event)
        return len(fresh)

    def reserve(
        self,
        target: SaveTarget,
        batch_keys: tuple[bytes, ...],
        *,
        to_remote: bool = True,
        tenant: bytes = DEFAULT_TENANT,
        parents: tuple[bytes, ...] = (),
    ) -> StagedBatch | None:
        """A ring region laid out as the chunk of ``batch_keys`` for ``target``
        (one ``tenant``'s blocks; ``parents``: the keys before its chains'
        runs, docs/decisions/0070), with its header written; the caller fills
        the data section. None when the ring is full."""
        created = time.time_ns()
        header = encode_header(
            target.spec,
            target.namespace,
            batch_keys,
            creator=f"{os.getpid()}@{HOST}",
            created_ns=created,
            tenant=tenant,
        )
        layout = ChunkLayout(target.spec, len(batch_keys), len(header))
        file_bytes = layout.file_size
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
                owner=(target, layout, tenant, parents),
                to_remote=to_remote,
            ),  # fmt: skip
            layout,
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
        target, layout, tenant, parents = _owner(batch)
        config = self.config
        try:
            if self._engine is None:
                self._engine = make_engine(config.io_engine, config.io_queue_depth)
                # Pinned once: the writer's O_DIRECT writes all come from the
                # ring, and pinning its 4 KiB shmem pages per request costs
                # about 13% of the write time (docs/decisions/0012).
                self._engine.register_buffer(self.ring.data.data)
            padded = None
            if config.direct_io:  # regions are page-aligned and padded
                padded = self.ring.view(batch.region)[: align_up(batch.image.size)]
            path, size = publish_image(
                target.publisher.dir,
                target.namespace,
                batch.chunk_id,
                batch.image,
                self._engine,
                sync=config.fsync == "chunk",
                padded=padded,
                tail_offset=layout.checksum_offset,
                fill_tail=lambda: _fill_checksums(batch.image, layout),
            )
            record = ChunkRecord.new(
                batch.chunk_id, target.fingerprint, batch.keys, size,
                batch.created_ns, tenant,
            )  # fmt: skip
            target.publisher.commit(
                record, path, touched=target.touches.take(), parents=parents
            )
            if self.remote is not None and batch.to_remote:
                self._offer_remote(batch, target, layout)
        finally:
            target.publisher.release(batch.keys)

    def _offer_remote(
        self, batch: SaveBatch, target: SaveTarget, layout: ChunkLayout
    ) -> None:
        """Hand the published blocks to the remote tier, which reads them from
        the region (checksums included) and releases it when done."""
        assert self.remote is not None
        ring, region = self.ring, batch.region
        batch.held = True
        try:
            self.remote.offer_blocks(
                target.spec, target.fingerprint, batch.keys,
                block_pieces(batch.image.ctypes.data, layout),
                lambda: ring.release(region),
            )  # fmt: skip
        except Exception:
            batch.held = False  # never offered: the writer releases it
            raise

    def _discard(self, batch: SaveBatch) -> None:
        target = _owner(batch)[0]
        target.publisher.counters.add(failed_batches=1)
        target.publisher.release(batch.keys)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything staged so far is published, and its remote
        puts (if any) have returned. False on timeout."""
        began = time.monotonic()
        if not self.writer.flush(timeout_s):
            return False
        if self.remote is None:
            return True
        left = None if timeout_s is None else timeout_s - (time.monotonic() - began)
        return self.remote.drain(_REMOTE_DRAIN_S if left is None else max(0.0, left))

    def close(self) -> None:
        """Drain, stop the writer, release its engine and unlink the ring
        (once no remote put reads it any more)."""
        self.writer.close()
        if self._engine is not None:
            self._engine.close()
        if self.remote is not None and not self.remote.drain(_REMOTE_DRAIN_S):
            # a put still reads the ring: unmapping it would crash the process;
            # the next ring created here removes the file (remove_stale_rings)
            logger.warning("remote puts still running at close; the ring is left")
            return
        self.ring.close()


def _owner(
    batch: SaveBatch,
) -> tuple[SaveTarget, ChunkLayout, bytes, tuple[bytes, ...]]:
    owner = batch.owner
    assert isinstance(owner, tuple), "every batch is reserved with its target"
    return owner


def _fill_checksums(image: np.ndarray, layout: ChunkLayout) -> None:
    """The checksum table of a filled image; runs while the data section's
    first writes are at the disk."""
    count = layout.n_blocks
    sums = np.empty((count, len(layout.spec.layers)), dtype="<u8")
    by_layer: dict[int, list[np.ndarray]] = {}
    for part in layout.parts():
        begin = layout.data_start + part.begin
        by_layer.setdefault(part.layer_index, []).append(
            image[begin : layout.data_start + part.end]
        )
    for col, parts in by_layer.items():
        sums[:, col] = layer_checksums(parts, count)
    image[layout.checksum_offset :] = sums.view(np.uint8).reshape(-1)


def block_pieces(base: int, layout: ChunkLayout) -> list[list[tuple[int, int]]]:
    """Per block of a chunk image at address ``base``: ``(address, bytes)`` of
    its checksum-table row, then of its row of every tensor in file order (a
    remote value's body, see npukv_store.remote.value)."""
    num_layers = len(layout.spec.layers)
    parts = [
        (base + layout.data_start + part.begin, part.row_bytes)
        for part in layout.parts()
    ]
    table = base + layout.checksum_offset
    return [
        [(table + i * num_layers * 8, num_layers * 8)]
        + [(start + i * row, row) for start, row in parts]
        for i in range(layout.n_blocks)
    ]


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


class StagedSave:
    """Blocks claimed for saving and their reserved ring region (see
    :meth:`KVStore.begin_save`).

    Attributes:
        keys: the claimed keys, in row order.
        indices: position of each claimed key in the keys given to begin_save.
        image: the region (uint8), exactly the chunk file being built.
    """

    __slots__ = ("batch", "image", "indices", "keys", "spec")

    def __init__(self, spec: NamespaceSpec, batch: StagedBatch, indices: list[int]):
        self.spec = spec
        self.batch = batch
        self.keys = batch.keys
        self.indices = indices
        self.image = batch.image

    def layer_address(self, layer_index: int) -> int:
        """Address of layer ``layer_index``'s first row; rows are that layer's
        ``row_bytes`` apart."""
        base: int = self.image.ctypes.data
        return base + self.batch.layout.layer_offset(layer_index)
