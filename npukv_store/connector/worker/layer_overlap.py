"""Refuse a registration in which two layers of one KV cache group share bytes.

Runs in: the worker (connector), once, at register_kv_caches; pure functions
of the layouts :mod:`.pages` described.

    refuse_shared_layers(layers) - LayoutError naming the first two layers of
                                   one group whose pages share a byte

Within one KV cache group vLLM gives every layer memory of its own: the
group's block ids index each layer's pages alike. Layers of *different* groups
may share a backing tensor (vLLM's hybrid allocation, vllm-ascend's one backing
tensor for hybrids), because the block pool hands the groups disjoint block
ids. Two layers of one group sharing bytes therefore means that at least one of
them does not hold its own KV: vllm-ascend's KVPP registers every layer another
rank owns as a view of one of two scratch buffers
(vllm_ascend/worker/kvpp_cache.py, ``allocate_kvpp_cache``). Saving such a
layer would store another layer's bytes under its name, and no checksum could
tell. The scheduler refuses KVPP by its flag (namespace.py); this check holds
whatever the flag is called in the next release (decision 0068).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from npukv_store.connector.worker.pages import (
    LayerLayout,
    LayoutError,
    Segment,
    segments_overlap,
)


def refuse_shared_layers(layers: Iterable[tuple[int, LayerLayout]]) -> None:
    """Raise LayoutError if two layers of one group share a byte of any block.

    ``layers``: (KV cache group index, layout) per registered layer.
    Only layers whose address spans meet are compared segment by segment
    (a sweep over the spans), so the usual layer-major layouts cost one sort.
    """
    by_group: dict[int, list[LayerLayout]] = defaultdict(list)
    for group, layout in layers:
        by_group[group].append(layout)
    for group, layouts in sorted(by_group.items()):
        spans = sorted(
            (_span(layout), index, layout)
            for index, layout in enumerate(layouts)
            if layout.segments
        )
        open_spans: list[tuple[int, LayerLayout]] = []  # (end, layout)
        for (start, end), _, layout in spans:
            open_spans = [(e, other) for e, other in open_spans if e > start]
            for _, other in open_spans:
                if _share_bytes(layout.segments, other.segments):
                    first, second = sorted((other.layer_name, layout.layer_name))
                    raise LayoutError(
                        f"layers {first!r} and {second!r} of KV cache group {group}:"
                        " found KV pages that share bytes, expected each layer's"
                        " own memory (a layer registered as a view of a shared"
                        " buffer, as vllm-ascend's KVPP does for the layers other"
                        " ranks own, holds no KV of its own to save)"
                    )
            open_spans.append((end, layout))


def _span(layout: LayerLayout) -> tuple[int, int]:
    """The lowest and one past the highest address of any block of the layer."""
    start = min(s.base_ptr for s in layout.segments)
    end = max(
        s.base_ptr + (s.num_blocks - 1) * s.block_stride + s.run_bytes
        for s in layout.segments
    )
    return start, end


def _share_bytes(a: tuple[Segment, ...], b: tuple[Segment, ...]) -> bool:
    return any(segments_overlap(x, y) for x in a for y in b)
