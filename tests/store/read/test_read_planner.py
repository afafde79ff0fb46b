"""The read planner without files: synthetic headers, destination buffers and
page-cache residency, and the rules every plan keeps."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.io.direct import aligned_buffer
from npukv_store.store.format import ChunkHeader, TensorEntry
from npukv_store.store.read.plan import (
    ReadTuning,
    Route,
    plan_chunk_read,
)
from npukv_store.store.read.rows import ChunkRows

SHARES = [0.0, 0.2, 0.49, 0.5, 0.9, 1.0]


def synthetic_header(num_blocks: int, layer_row_bytes: list[list[int]]) -> ChunkHeader:
    """Tensors laid end to end from 4096, each ``num_blocks`` rows."""
    layers, offset = [], 4096
    for li, tensors in enumerate(layer_row_bytes):
        entries = []
        for ti, row_bytes in enumerate(tensors):
            end = offset + num_blocks * row_bytes
            entries.append(
                TensorEntry(f"l{li}.t{ti}", "U8", (num_blocks, row_bytes), offset, end)
            )
            offset = end
        layers.append(tuple(entries))
    return ChunkHeader(
        path="synthetic", file_size=offset, data_start=4096, namespace="ns",
        keys=tuple(bytes([b, 1]) for b in range(num_blocks)),
        layer_names=tuple(f"l{i}" for i in range(len(layers))),
        layers=tuple(layers), checksums=np.zeros((num_blocks, len(layers)), np.uint64),
        metadata={},
    )  # fmt: skip


@st.composite
def read_cases(draw):
    num_blocks = draw(st.integers(1, 24))
    row_sizes = st.sampled_from([512, 3000, 4096, 8192, 1 << 17])
    layer_rows = draw(
        st.lists(st.lists(row_sizes, min_size=1, max_size=2), min_size=1, max_size=5)
    )
    header = synthetic_header(num_blocks, layer_rows)
    rows = draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, unique=True))
    keys = draw(st.permutations(range(len(rows))))
    items = list(zip(keys, rows, strict=True))
    layers = draw(
        st.lists(st.integers(0, len(layer_rows) - 1), min_size=1, unique=True)
    )
    misalign = draw(st.sampled_from([0, 0, 64]))
    dest = {
        e.name: aligned_buffer(len(items) * e.row_bytes + misalign)[misalign:].reshape(
            len(items), e.row_bytes
        )
        for layer in header.layers
        for e in layer
    }
    known = draw(st.booleans())
    shares = draw(st.lists(st.sampled_from(SHARES), min_size=64, max_size=64))

    def residency(ranges):
        # the same answer for the same range, whatever order it is asked in
        if not known:
            return None
        return np.array([shares[(o // 4096 + n) % 64] for o, n in ranges.tolist()])

    tuning = ReadTuning(
        stream_above_bytes=draw(st.sampled_from([0, 4096, 4 << 20])),
        stream_uncached=draw(st.booleans()),
        cached_tasks_per_chunk=draw(st.integers(1, 4)),
        max_request_bytes=draw(st.sampled_from([8192, 4 << 20])),
        max_iovecs=draw(st.integers(1, 64)),
    )
    flags = {"first_read": draw(st.booleans()), "verify": draw(st.booleans())}
    return header, ChunkRows(items), layers, dest, residency, tuning, flags


@settings(max_examples=300, deadline=None)
@given(read_cases())
def test_every_segment_is_read_once_by_the_route_of_its_layer(case):
    header, rows, layers, dest, residency, tuning, flags = case
    plan = plan_chunk_read(header, rows, layers, dest, residency, tuning, **flags)
    assert [lr.layer for lr in plan.layers] == layers
    by_route = {
        route: [lr for lr in plan.layers if lr.route is route] for route in Route
    }
    assert sorted(li for task in plan.cached_tasks for li in task) == sorted(
        lr.layer for lr in by_route[Route.CACHED]
    )
    assert len(plan.cached_tasks) <= tuning.cached_tasks
    assert sorted(plan.streamed) == sorted(lr.layer for lr in by_route[Route.STREAMED])
    engine_parts = sorted(
        (pos, s.offset) for request in plan.requests for pos, s in request.parts
    )
    expected_parts = sorted(
        (pos, s.offset)
        for pos, lr in enumerate(plan.layers)
        if lr.route in (Route.ENGINE, Route.DIRECT)
        for s in lr.segments
    )
    assert engine_parts == expected_parts
    for lr in plan.layers:
        wanted = len(rows.items) * sum(e.row_bytes for e in header.layers[lr.layer])
        assert sum(s.dest.nbytes for s in lr.segments) == wanted
        assert len(lr.direct) == len(lr.segments)
    text = plan.explain()
    assert all(lr.route.value in text for lr in plan.layers)


@settings(max_examples=300, deadline=None)
@given(read_cases())
def test_routes_follow_residency_alignment_and_tuning(case):
    header, rows, layers, dest, residency, tuning, flags = case
    plan = plan_chunk_read(header, rows, layers, dest, residency, tuning, **flags)
    known = residency(np.zeros((1, 2), np.int64)) is not None
    ranges = {}
    for lr in plan.layers:
        asked = np.array([(s.offset, s.dest.nbytes) for s in lr.segments])
        found = residency(asked) if known else np.zeros(len(asked))
        ranges[lr.layer] = found
        wholly_cached = known and bool((found == 1.0).all())
        assert (lr.route is Route.CACHED) == (wholly_cached and flags["verify"])
        for segment, direct, share in zip(lr.segments, lr.direct, found, strict=True):
            aligned = (
                segment.offset | segment.dest.nbytes | segment.dest.ctypes.data
            ) % 4096 == 0
            may = flags["first_read"] and known and not wholly_cached
            assert direct == (may and aligned and share < 0.5)
        if lr.route is Route.STREAMED:
            assert tuning.stream_uncached
            assert not any(lr.direct)
            assert max(s.dest.nbytes for s in lr.segments) > tuning.stream_above_bytes
        if lr.route is Route.DIRECT:
            assert all(lr.direct)
    buffered = plan.streamed or any(not r.direct for r in plan.requests)
    assert plan.readahead == bool(buffered)
    assert plan.direct_bytes == sum(
        s.dest.nbytes
        for lr in plan.layers
        for s, d in zip(lr.segments, lr.direct, strict=True)
        if d
    )


@settings(max_examples=150, deadline=None)
@given(read_cases(), st.sampled_from(list(Route)))
def test_a_forced_route_is_taken_wherever_it_can_be(case, route):
    header, rows, layers, dest, residency, tuning, flags = case
    forced = ReadTuning(only_route=route)
    plan = plan_chunk_read(header, rows, layers, dest, residency, forced, **flags)
    for lr in plan.layers:
        if route is Route.DIRECT:
            assert lr.route in (Route.DIRECT, Route.ENGINE)
            assert lr.route is Route.ENGINE or all(lr.direct)
        else:
            assert lr.route is route


def test_explain_names_routes_layers_and_reasons():
    header = synthetic_header(8, [[1 << 20], [1 << 20], [4096], [4096]])
    rows = ChunkRows([(i, i) for i in range(8)])
    dest = {
        e.name: aligned_buffer(8 * e.row_bytes).reshape(8, e.row_bytes)
        for layer in header.layers
        for e in layer
    }

    def residency(ranges):  # layer 0 cached, the rest cold
        return np.where(ranges[:, 0] < 4096 + (8 << 20), 1.0, 0.0)

    plan = plan_chunk_read(
        header, rows, [0, 1, 2, 3], dest, residency, ReadTuning(),
        first_read=True, verify=True,
    )  # fmt: skip
    assert plan.routes() == {
        0: Route.CACHED,
        1: Route.DIRECT,
        2: Route.DIRECT,
        3: Route.DIRECT,
    }
    text = plan.explain()
    assert "cached   layers 0 (8.0 MiB): wholly in the page cache" in text
    assert "direct   layers 1-3" in text
    # the second read of the chunk is buffered; 8 MiB segments are streamed
    again = plan_chunk_read(
        header, rows, [0, 1, 2, 3], dest, residency, ReadTuning(),
        first_read=False, verify=True,
    )  # fmt: skip
    assert again.routes() == {
        0: Route.CACHED, 1: Route.STREAMED, 2: Route.ENGINE, 3: Route.ENGINE,
    }  # fmt: skip
    assert "ranges of 8.0 MiB > one request" in again.explain()
