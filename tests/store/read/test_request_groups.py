"""How the planner turns tensor segments into engine requests: file-adjacent
direct segments become one vectored read, within the size and iovec limits;
and how runs of rows are found."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.store.read import routes as read_routes
from npukv_store.store.read.plan import ReadTuning, Segment, _requests
from npukv_store.store.read.rows import _row_runs

TUNING = ReadTuning()


@st.composite
def engine_segments(draw):
    """Segments of random sizes laid end to end with random gaps, each direct
    or buffered, in a shuffled order: ``(layer position, segment, direct)``."""
    count = draw(st.integers(1, 40))
    sizes = draw(st.lists(st.integers(1, 3 << 20), min_size=count, max_size=count))
    gaps = draw(
        st.lists(st.sampled_from([0, 0, 0, 4096]), min_size=count, max_size=count)
    )
    direct = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    segments, offset = [], 0
    for size, gap in zip(sizes, gaps, strict=True):
        offset += gap
        segments.append(Segment(offset, 0, 1, np.empty(size, np.uint8)))
        offset += size
    order = draw(st.permutations(range(count)))
    return [(0, segments[i], direct[i]) for i in order]


@settings(max_examples=200, deadline=None)
@given(engine_segments())
def test_requests_partition_segments_into_contiguous_bounded_reads(entries):
    requests = _requests(entries, TUNING)
    parts = sorted(id(s) for r in requests for _, s in r.parts)
    assert parts == sorted(id(s) for _, s, _ in entries)
    direct_of = {id(s): d for _, s, d in entries}
    for request in requests:
        assert {direct_of[id(s)] for _, s in request.parts} == {request.direct}
        assert len(request.parts) == 1 or request.direct  # only direct merges
        assert len(request.parts) <= TUNING.max_iovecs
        total = sum(s.dest.nbytes for _, s in request.parts)
        assert len(request.parts) == 1 or total <= TUNING.max_request_bytes
        for (_, a), (_, b) in zip(request.parts, request.parts[1:], strict=False):
            assert a.offset + a.dest.nbytes == b.offset
    # maximal: two consecutive direct requests that touch could not be merged
    for left, right in zip(requests, requests[1:], strict=False):
        last, first = left.parts[-1][1], right.parts[0][1]
        touching = last.offset + last.dest.nbytes == first.offset
        if left.direct and right.direct and touching:
            merged = sum(s.dest.nbytes for _, s in left.parts) + first.dest.nbytes
            assert (
                merged > TUNING.max_request_bytes
                or len(left.parts) == TUNING.max_iovecs
            )


def test_a_whole_chunk_of_1_mib_segments_goes_in_4_mib_reads():
    segments = [
        Segment(4096 + i * (1 << 20), 0, 1, np.empty(1 << 20, np.uint8))
        for i in range(64)
    ]
    direct = _requests([(0, s, True) for s in segments], TUNING)
    assert [len(r.parts) for r in direct] == [4] * 16
    buffered = _requests([(0, s, False) for s in segments], TUNING)
    assert [len(r.parts) for r in buffered] == [1] * 64


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=30, unique=True),
    st.data(),
)
def test_row_runs_cover_items_in_up_or_down_runs(rows, data):
    """_row_runs: every item once; within a run rows go up by one and key
    indices by the run's step (+1 or -1); no two neighbouring runs could merge."""
    keys = data.draw(st.permutations(range(len(rows))))
    items = list(zip(keys, rows, strict=True))
    runs = _row_runs(items)
    covered = {
        (first + step * j, row + j)
        for first, row, count, step in runs
        for j in range(count)
    }
    assert covered == set(items)
    assert sum(count for _, _, count, _ in runs) == len(items)
    for (first, row, count, step), nxt in zip(runs, runs[1:], strict=False):
        assert step in (1, -1)
        if nxt[1] == row + count:  # adjacent rows: the keys must break the step
            last_key = first + step * (count - 1)
            gap = nxt[0] - last_key
            assert gap not in (1, -1) or (count > 1 and gap != step)


def test_a_reversed_run_is_read_from_the_cache_in_one_call(tmp_path):
    """Keys whose rows go down in memory while the chunk's go up (a descending
    run of vLLM blocks) come back right, through the one-pass cached path, and
    a corrupt row there is reported against the right key."""
    from npukv_store import KVStore, StoreConfig
    from tests.support.blocks import block_tensors, empty_blocks, tiny_spec

    spec = tiny_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "c"), capacity="64MiB")
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(16 * 8))
        store.put(keys, block_tensors(spec, keys))
        calls = []
        real = read_routes.native.pread_layers_xxh3

        def counted(fd, layers, rows):
            calls.append((rows, [[part[2] for part in parts] for parts in layers]))
            return real(fd, layers, rows)

        read_routes.native.pread_layers_xxh3 = counted
        try:
            backwards = keys[::-1]
            out = empty_blocks(spec, 8)
            assert store.read(backwards, out) == [True] * 8
        finally:
            read_routes.native.pread_layers_xxh3 = real
        for name, array in block_tensors(spec, backwards).items():
            np.testing.assert_array_equal(out[name], array)
        # all eight rows in each call, every layer once, every part reversed
        assert {rows for rows, _ in calls} == {8}
        flags = [layer for _, layers in calls for layer in layers]
        assert flags == [[True, True]] * len(spec.layers)
        # a flipped byte in chunk row 2 is a miss for key index 5 only
        import os

        from npukv_store.store.format_checks import parse_header

        (path,) = [
            os.path.join(d, f)
            for d, _, files in os.walk(config.cache_dir)
            for f in files
            if f.endswith(".safetensors")
        ]
        fd = os.open(path, os.O_RDWR)
        try:
            entry = parse_header(fd, path).layers[1][1]
            offset = entry.begin + 2 * entry.row_bytes + 5
            os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
        finally:
            os.close(fd)
        store._reader.clear()  # forget the cached header and the first read
        assert store.read(backwards, empty_blocks(spec, 8)) == [
            i != 5 for i in range(8)
        ]
