"""Where each block's KV bytes lie in vLLM's per-layer KV values, by stride arithmetic.

Runs in: the worker (connector); pure functions of tensor metadata, thread-safe.

    describe_layer(name, kv, num_blocks, rows_per_block=1) -> LayerLayout | None
        the contiguous byte runs (Segments) of one block of one layer
    page_layout(name, kv_caches, num_blocks, page_bytes, ...) -> LayerLayout
        describe_layer of a registered layer, checked against the spec's page

Layouts are described once, at registration; :mod:`.block_runs` turns them
into each step's copy runs.

Only ``shape``, ``stride()``, ``element_size()`` and ``data_ptr()`` are read: no
copy, no device call, no storage size (vllm-ascend over-allocates raw buffers by
2 MiB to align them, so ``untyped_storage().nbytes()`` is not the block grid). The
same code therefore describes CPU, CUDA and NPU tensors. torch is not imported
(docs/architecture.md's import direction keeps it to connector/ and device/):
any object with those four members is a tensor here.

A page is one block's bytes in segment order: within a tensor in address order
(physical, not logical: an LBNHC page is [N, H, C]; an LHBNC page is head-major),
tensors in tuple or list order. Pages are opaque, copied back to the same layout,
never interpreted; another layout gives other pages, so the namespace pins it.

Kernel blocks (vllm-ascend's hybrid models): dim 0 may hold s rows per vLLM
block, block b being rows ``b*s .. b*s+s-1``; its page is their runs in address
order (dense rows: one run, the page of the unsplit layout).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from npukv_store.errors import ConfigError

logger = logging.getLogger(__name__)

ACL_FORMAT_NCHW = 0
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
# Formats whose bytes follow the logical strides; NZ (310P) and the other
# private formats tile the data in hardware fractals the strides do not describe.
_STRIDED_FORMATS = (ACL_FORMAT_NCHW, ACL_FORMAT_ND)


class LayoutError(ConfigError):
    """A layer's KV value cannot be stored as contiguous byte runs per block.

    The message names the layer, what was found and what was expected.
    """


@dataclass(frozen=True, slots=True)
class Segment:
    """One contiguous run of every block: block b's run is the ``run_bytes``
    bytes at ``base_ptr + b * block_stride``, for 0 <= b < ``num_blocks``."""

    base_ptr: int  # address of block 0's run
    block_stride: int  # bytes between consecutive blocks
    run_bytes: int  # bytes copied per block
    num_blocks: int  # blocks addressable (size of the block dim)


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """The segments of one layer, in page order; ``page_bytes`` is their sum."""

    layer_name: str
    segments: tuple[Segment, ...]
    page_bytes: int
    kind: str = ""  # for logs, e.g. "tensor[B,2,32,128]", "tuple(k,v)"


def describe_layer(
    name: str,
    kv: Any,
    num_blocks: int,
    *,
    npu_format: Callable[[Any], int] | None = None,
    rows_per_block: int = 1,
) -> LayerLayout | None:
    """The byte runs of one block of the KV value vLLM hands over for a layer.

    Args:
        name: the layer name (may be "": vllm-ascend's linear-attention layers).
        kv: a tensor whose dim 0 is the block dim (any physical order, e.g. the
            standardised [B, H, N, C] views of one shared buffer), a legacy
            [2, B, ...] tensor (K/V planes outermost), or a tuple or list of such
            block-major tensors (Ascend (k, v), MLA (nope, rope), state lists).
        num_blocks: blocks the cache must hold; every tensor needs at least these.
        npu_format: for NPU tensors, ``torch_npu.get_npu_format``; ``None`` skips
            the storage-format check.
        rows_per_block: rows of the block dim per block (kernel blocks, see
            above); every tensor needs ``num_blocks * rows_per_block`` rows.

    Returns:
        The layout, or ``None`` for an empty tuple or list (nothing to store).
        A member of a tuple or list whose bytes lie wholly inside the other
        members' bytes of the same block (compressed MLA's ``full`` view over
        ``k`` + ``scale``) is dropped, so no byte is stored twice.

    Raises:
        LayoutError: not a tensor, fewer than ``num_blocks`` blocks, elements
            that overlap, a block payload with gaps (a slice such as
            ``cache[..., :D]``), members that partly overlap, or an NPU private
            storage format (FRACTAL_NZ).
    """
    if num_blocks < 1 or rows_per_block < 1:
        raise LayoutError(
            f"layer {name!r}: found num_blocks={num_blocks}, rows_per_block="
            f"{rows_per_block}, expected both >= 1"
        )
    rows = num_blocks * rows_per_block
    if isinstance(kv, tuple | list):
        if not kv:
            return None
        members = [
            _group_rows(
                _tensor_segments(name, f"[{i}]", t, rows, npu_format), rows_per_block
            )
            for i, t in enumerate(kv)
        ]
        keep = _drop_covered(name, [segs for segs, _ in members])
        segments, kinds = [], []
        for (segs, member_kind), kept in zip(members, keep, strict=True):
            segments += segs if kept else []
            kinds.append(member_kind if kept else f"dropped {member_kind}")
        kind = f"{type(kv).__name__}({', '.join(kinds)})"
    else:
        segments, kind = _group_rows(
            _tensor_segments(name, "", kv, rows, npu_format), rows_per_block
        )
    page_bytes = sum(s.run_bytes for s in segments)
    return LayerLayout(name, tuple(segments), page_bytes, kind)


def _group_rows(
    described: tuple[list[Segment], str], rows: int
) -> tuple[list[Segment], str]:
    """Blocks of ``rows`` adjacent rows (row j of block b is row b*rows + j)
    from one row's segments: runs in address order, touching ones merged."""
    segments, kind = described
    if rows == 1:
        return segments, kind
    merged: list[list[int]] = []  # [base_ptr, block_stride, run_bytes, num_blocks]
    for base, run, stride, blocks in sorted(
        (s.base_ptr + j * s.block_stride, s.run_bytes, s.block_stride, s.num_blocks)
        for s in segments
        for j in range(rows)
    ):
        if merged and merged[-1][0] + merged[-1][2] == base:
            merged[-1][2] += run
        else:
            merged.append([base, stride * rows, run, blocks // rows])
    return [Segment(*m) for m in merged], f"{kind} {rows} rows per block"


def page_layout(
    name: str,
    kv_caches: Mapping[str, Any],
    num_blocks: int,
    page_bytes: int,
    npu_format: Callable[[Any], int] | None = None,
    *,
    rows_per_block: int = 1,
) -> LayerLayout:
    """:func:`describe_layer` of ``kv_caches[name]``, which must exist and
    have pages of exactly ``page_bytes`` (the KV cache spec's page size).

    ``rows_per_block`` (kernel blocks the platform may use) is tried when one
    row per block does not give ``page_bytes``; only one can (s rows: s times
    one row's page).

    Raises:
        ConfigError: the layer is not among ``kv_caches``.
        LayoutError: its pages are not byte runs of that size.
    """
    if name not in kv_caches:
        raise ConfigError(
            f"layer {name!r}: in the KV cache config but not among the "
            f"{len(kv_caches)} registered KV caches"
        )
    kv = kv_caches[name]
    layout = describe_layer(name, kv, num_blocks, npu_format=npu_format)
    tried = ""
    if layout is not None and layout.page_bytes != page_bytes and rows_per_block > 1:
        tried = f" (nor with {rows_per_block} rows per block)"
        try:
            split = describe_layer(
                name,
                kv,
                num_blocks,
                npu_format=npu_format,
                rows_per_block=rows_per_block,
            )
        except LayoutError as exc:  # fewer rows than the split needs
            tried, split = f" (and with {rows_per_block} rows per block: {exc})", None
        if split is not None and split.page_bytes == page_bytes:
            layout = split
    if layout is None or layout.page_bytes != page_bytes:
        found = "nothing" if layout is None else f"{layout.page_bytes} bytes"
        raise LayoutError(
            f"layer {name!r}: block page of {found}{tried}, expected "
            f"{page_bytes} bytes (the KV cache spec's page size)"
        )
    return layout


def _tensor_segments(
    name: str,
    where: str,
    t: Any,
    num_blocks: int,
    npu_format: Callable[[Any], int] | None,
) -> tuple[list[Segment], str]:
    """Segments of one tensor in address order, and a short description."""
    what = f"layer {name!r}{where}"
    if not all(hasattr(t, a) for a in ("shape", "stride", "element_size", "data_ptr")):
        raise LayoutError(f"{what}: found {type(t).__name__}, expected a tensor")
    if npu_format is not None:
        fmt = int(npu_format(t))
        if fmt not in _STRIDED_FORMATS:
            raise LayoutError(
                f"{what}: found NPU storage format {fmt}"
                f"{' (FRACTAL_NZ)' if fmt == ACL_FORMAT_FRACTAL_NZ else ''}, expected"
                f" ND ({ACL_FORMAT_ND}): an NZ/private format's bytes do not follow"
                " the strides and cannot be copied as byte runs; allocate the KV"
                " cache in ND"
            )
    shape = tuple(int(n) for n in t.shape)
    elem = int(t.element_size())
    strides = [int(s) * elem for s in t.stride()]
    # vLLM's legacy [2, B, ...] keeps K/V planes outermost; with num_blocks <= 2
    # a block-major [B, ...] could look the same, so then only 5-D counts.
    legacy = len(shape) >= 2 and shape[0] == 2 and shape[1] >= num_blocks
    legacy = legacy and (num_blocks > 2 or len(shape) == 5)
    block_dim = 1 if legacy else 0
    dims_text = ",".join("B" if d == block_dim else str(n) for d, n in enumerate(shape))
    kind = f"{'legacy' if legacy else 'tensor'}[{dims_text}]"
    if not shape or shape[block_dim] < num_blocks:
        raise LayoutError(
            f"{what}: found shape {list(shape)} ({kind}), expected at least"
            f" {num_blocks} blocks in dim {block_dim}"
        )
    _check_no_overlap(what, shape, strides, elem)

    # The dense run: inner dims, in stride order, that tile with no gap.
    dims = [d for d in range(len(shape)) if d != block_dim and shape[d] > 1]
    run_bytes, run_dims = elem, set()
    for d in sorted(dims, key=lambda d: strides[d]):
        if strides[d] != run_bytes:
            break
        run_bytes *= shape[d]
        run_dims.add(d)
    # Tokens x channels (the last two dims) must be whole in one run. Splitting
    # by an outer dim (K/V plane, or head in LHBNC/BHLNC) is a layout; a split
    # inside a token's channels is a slice of the payload (cache[..., :D]),
    # whose other half nobody would store: refused instead of copied as rows.
    last_two = {d for d in range(len(shape))[-2:] if d != block_dim and shape[d] > 1}
    if not last_two <= run_dims:
        raise LayoutError(
            f"{what}: found shape {list(shape)} with byte strides {strides}, whose"
            f" densest run is {run_bytes} bytes; expected the last two dims"
            " (tokens x channels) dense: a gap inside them means a slice of the"
            " block payload (e.g. cache[..., :D] or cache[..., ::2])"
        )
    outer = [d for d in dims if d not in run_dims]
    offsets = sorted(
        sum(i * strides[d] for i, d in zip(index, outer, strict=True))
        for index in itertools.product(*(range(shape[d]) for d in outer))
    )
    base = int(t.data_ptr())
    segments = [
        Segment(base + off, strides[block_dim], run_bytes, shape[block_dim])
        for off in offsets
    ]
    if len(segments) > 1:
        kind += f" x{len(segments)} runs"
    return segments, kind


def _check_no_overlap(
    what: str, shape: tuple[int, ...], strides: list[int], elem: int
) -> None:
    """Refuse a tensor in which two indices share bytes (stride 0, expand, ...).

    Sufficient test (as torch's own): in stride order each stride passes the
    reach of all smaller dims. It refuses some exotic interleavings that do
    not overlap; no vLLM or vllm-ascend layout is one of them.
    """
    reach = 0
    for d in sorted(
        (d for d in range(len(shape)) if shape[d] > 1), key=strides.__getitem__
    ):
        if strides[d] < reach + elem:
            raise LayoutError(
                f"{what}: found byte strides {strides} for shape {list(shape)}, whose"
                f" dim {d} revisits bytes; expected elements that do not overlap"
            )
        reach += (shape[d] - 1) * strides[d]


def _drop_covered(name: str, members: list[list[Segment]]) -> list[bool]:
    """Which members to keep: drop views lying inside the others' bytes.

    Tried last to first, as vllm-ascend appends the overlapping ``full`` view
    after ``k`` and ``scale``. The kept members must then be disjoint in every
    pair of blocks, else the overlap is partial and refused.
    """
    keep = [True] * len(members)
    for i in reversed(range(len(members))):
        others = [s for j, m in enumerate(members) if j != i and keep[j] for s in m]
        if others and all(_covered(s, others) for s in members[i]):
            keep[i] = False
            logger.debug(
                "layer %r: member %d lies inside the other members' bytes; not stored",
                name,
                i,
            )
    for i, j in itertools.combinations([i for i, k in enumerate(keep) if k], 2):
        if any(segments_overlap(a, b) for a in members[i] for b in members[j]):
            raise LayoutError(
                f"layer {name!r}: found members [{i}] and [{j}] sharing bytes without"
                " either lying wholly inside the others; expected disjoint tensors,"
                " or views that cover whole members of the same block"
            )
    return keep


def _covered(seg: Segment, others: list[Segment]) -> bool:
    """Whether block b of ``seg`` lies inside block b of ``others``, for all b."""
    lo, hi = seg.base_ptr, seg.base_ptr + seg.run_bytes
    spans = sorted(
        (o.base_ptr, o.base_ptr + o.run_bytes)
        for o in others
        if o.block_stride == seg.block_stride
    )
    for start, end in spans:  # merged walk: advance lo through touching spans
        if start > lo:
            break
        lo = max(lo, end)
    return lo >= hi


def segments_overlap(a: Segment, b: Segment) -> bool:
    """Whether any block of ``a`` shares a byte with any block of ``b``."""
    a_end = a.base_ptr + (a.num_blocks - 1) * a.block_stride + a.run_bytes
    b_end = b.base_ptr + (b.num_blocks - 1) * b.block_stride + b.run_bytes
    if a_end <= b.base_ptr or b_end <= a.base_ptr:
        return False
    stride = a.block_stride
    if stride != b.block_stride or stride <= 0:
        return True  # spans meet and no common period to reason with
    # Block i of a meets block j of b iff b0 - a1 < (i - j) * stride < b1 - a0.
    a0, a1 = a.base_ptr, a.base_ptr + a.run_bytes
    b0, b1 = b.base_ptr, b.base_ptr + b.run_bytes
    low = max((b0 - a1) // stride + 1, -(b.num_blocks - 1))
    high = min(-((a0 - b1) // stride) - 1, a.num_blocks - 1)
    return low <= high
