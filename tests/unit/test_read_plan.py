"""How ChunkReader turns tensor segments into requests: file-adjacent segments
on one fd become one vectored read, within the size and iovec limits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.store import chunk_reader
from npukv_store.store.chunk_reader import _file_adjacent_groups


@st.composite
def segment_plans(draw):
    """Segments of random sizes laid end to end with random gaps, each on one
    of two fds, in a shuffled order."""
    count = draw(st.integers(1, 40))
    sizes = draw(st.lists(st.integers(1, 3 << 20), min_size=count, max_size=count))
    gaps = draw(
        st.lists(st.sampled_from([0, 0, 0, 4096]), min_size=count, max_size=count)
    )
    fds = draw(st.lists(st.sampled_from([3, 4]), min_size=count, max_size=count))
    segments, offset = [], 0
    for size, gap in zip(sizes, gaps, strict=True):
        offset += gap
        segments.append((offset, 0, 1, np.empty(size, np.uint8)))
        offset += size
    order = draw(st.permutations(range(count)))
    return [segments[i] for i in order], [fds[i] for i in order]


@settings(max_examples=200, deadline=None)
@given(segment_plans())
def test_groups_partition_segments_into_contiguous_bounded_reads(plan):
    segments, fds = plan
    groups = _file_adjacent_groups(segments, fds, 3)
    assert sorted(i for group in groups for i in group) == list(range(len(segments)))
    for group in groups:
        assert len({fds[i] for i in group}) == 1
        assert len(group) == 1 or fds[group[0]] == 3  # only the direct fd merges
        assert len(group) <= chunk_reader._MAX_IOVECS
        total = sum(segments[i][3].nbytes for i in group)
        assert len(group) == 1 or total <= chunk_reader._MAX_REQUEST_BYTES
        for a, b in zip(group, group[1:], strict=False):
            assert segments[a][0] + segments[a][3].nbytes == segments[b][0]
    # maximal: two consecutive groups on one fd that touch could not be merged
    for left, right in zip(groups, groups[1:], strict=False):
        last, first = left[-1], right[0]
        touching = segments[last][0] + segments[last][3].nbytes == segments[first][0]
        if fds[last] == fds[first] == 3 and touching:
            merged = sum(segments[i][3].nbytes for i in left + right[:1])
            assert (
                merged > chunk_reader._MAX_REQUEST_BYTES
                or len(left) == chunk_reader._MAX_IOVECS
            )


def test_a_whole_chunk_of_1_mib_segments_goes_in_4_mib_reads():
    segments = [
        (4096 + i * (1 << 20), 0, 1, np.empty(1 << 20, np.uint8)) for i in range(64)
    ]
    groups = _file_adjacent_groups(segments, [5] * 64, 5)
    assert [len(group) for group in groups] == [4] * 16
    buffered = _file_adjacent_groups(segments, [5] * 64, None)
    assert [len(group) for group in buffered] == [1] * 64


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
    runs = chunk_reader._row_runs(items)
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
    from tests.conftest import block_tensors, empty_like_blocks, tiny_spec

    spec = tiny_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "c"), capacity="64MiB")
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(16 * 8))
        store.put(keys, block_tensors(spec, keys))
        calls = []
        real = chunk_reader.native.pread_layers_xxh3

        def counted(fd, layers, rows):
            calls.append((rows, [[part[2] for part in parts] for parts in layers]))
            return real(fd, layers, rows)

        chunk_reader.native.pread_layers_xxh3 = counted
        try:
            backwards = keys[::-1]
            out = empty_like_blocks(spec, 8)
            assert store.read(backwards, out) == [True] * 8
        finally:
            chunk_reader.native.pread_layers_xxh3 = real
        for name, array in block_tensors(spec, backwards).items():
            np.testing.assert_array_equal(out[name], array)
        # all eight rows in each call, every layer once, every part reversed
        assert {rows for rows, _ in calls} == {8}
        flags = [layer for _, layers in calls for layer in layers]
        assert flags == [[True, True]] * len(spec.layers)
        # a flipped byte in chunk row 2 is a miss for key index 5 only
        import os

        from npukv_store.store.format import parse_header

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
        assert store.read(backwards, empty_like_blocks(spec, 8)) == [
            i != 5 for i in range(8)
        ]
