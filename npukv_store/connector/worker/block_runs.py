"""The copy runs of one step: blocks of described layers <-> rows of a buffer.

Runs in: the worker (connector), on whichever thread issues the copy: the
forward thread (saves), the loader's threads (loads); a pure function of
layouts and block ids, thread-safe.

    build_runs(layouts, block_ids, ring_slots, ring_base, ring_row_bytes)
        -> (src_ptrs, dst_ptrs, sizes) gathering those blocks into ring rows;
        swap src and dst to scatter them back

Apart from :mod:`.pages`, which describes each layer once at registration
from its tensors: this runs for every save and load, on those
layouts alone (no tensor), and gives the int64 arrays device/'s ``copy_runs``
takes as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from npukv_store.connector.worker.pages import LayerLayout


def build_runs(
    layouts: Sequence[LayerLayout],
    block_ids: Sequence[int] | np.ndarray,
    ring_slots: Sequence[int] | np.ndarray,
    ring_base: int,
    ring_row_bytes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copy runs from blocks to ring rows: block_ids[i] goes to row ring_slots[i].

    A row holds the pages of ``layouts`` back to back, in order. Runs adjacent
    in both source and destination are merged (consecutive blocks of a
    contiguous page layout into consecutive rows become one run).

    Returns:
        (src_ptrs, dst_ptrs, sizes), int64 arrays of equal length; swap the
        first two to scatter rows back into the blocks.

    Raises:
        ValueError: a block id outside [0, num_blocks), a negative slot, a slot
            list of another length, or pages longer than a ring row.
    """
    blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    slots = np.asarray(ring_slots, dtype=np.int64).reshape(-1)
    if blocks.size != slots.size:
        raise ValueError(
            f"ring_slots: found {slots.size}, expected one per block id ({blocks.size})"
        )
    segments = [s for layout in layouts for s in layout.segments]
    if not segments or not blocks.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy(), empty.copy()
    base = np.array([s.base_ptr for s in segments], dtype=np.int64)
    stride = np.array([s.block_stride for s in segments], dtype=np.int64)
    run = np.array([s.run_bytes for s in segments], dtype=np.int64)
    if int(run.sum()) > ring_row_bytes:
        raise ValueError(
            f"ring_row_bytes: found {ring_row_bytes}, expected >= {int(run.sum())}"
            " (the pages of all layouts)"
        )
    limit = min(s.num_blocks for s in segments)
    bad = blocks[(blocks < 0) | (blocks >= limit)]
    if bad.size:
        raise ValueError(
            f"block_ids: found block id {int(bad[0])}, expected 0 <= id < {limit}"
        )
    if (slots < 0).any():
        raise ValueError(f"ring_slots: found slot {int(slots.min())}, expected >= 0")
    # Rows are (block, segment): block-major, segments in page order.
    src = (base[None, :] + blocks[:, None] * stride[None, :]).ravel()
    offsets = np.cumsum(run) - run
    dst = (ring_base + slots[:, None] * ring_row_bytes + offsets[None, :]).ravel()
    sizes = np.tile(run, blocks.size)
    joins = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    if not joins.any():
        return src, dst, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)
