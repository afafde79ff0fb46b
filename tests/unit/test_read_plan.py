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
