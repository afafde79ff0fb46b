"""copy_runs: native/copy.c and its pure-Python twin (NPUKV_NATIVE=0) pass the
same tests: gathers into a layer-major ring region and scatters back, paged
blocks, bounds checked before any byte moves, the threaded path, and a
property test against a plain in-order loop."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npukv_store import _twin, native

MiB = 1 << 20
THREAD_MINSIZE = 4 * MiB  # native/copy.c NKV_COPY_THREAD_MINSIZE
needs_native = pytest.mark.skipif(
    not native.IS_NATIVE, reason="NPUKV_NATIVE=0: the C extension is not in use"
)


@needs_native
def test_thread_threshold_is_exported():
    from npukv_store import _native

    assert _native._COPY_THREAD_MINSIZE == THREAD_MINSIZE


@pytest.fixture(params=["native", "twin"])
def impl(request, monkeypatch):
    """native.copy_runs on each: the twin bound here as NPUKV_NATIVE=0 binds
    it at import (tests/test_native.py checks that binding)."""
    if request.param == "twin":
        monkeypatch.setattr(native, "_copy_runs", _twin.copy_runs)
    elif not native.IS_NATIVE:
        pytest.skip("NPUKV_NATIVE=0: the C extension is not in use")
    return request.param


def to_runs(*rows: tuple[int, int, int, int, int]) -> np.ndarray:
    """(src_idx, src_off, dst_idx, dst_off, nbytes) rows as int64 [k, 5]."""
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def reference_copy(srcs, dsts, runs) -> int:
    """The semantics in the plainest form: in order, each run as memmove."""
    for src_idx, src_off, dst_idx, dst_off, nbytes in runs.tolist():
        piece = bytes(memoryview(srcs[src_idx]).cast("B")[src_off : src_off + nbytes])
        memoryview(dsts[dst_idx]).cast("B")[dst_off : dst_off + nbytes] = piece
    return int(runs[:, 4].sum()) if len(runs) else 0


def random_bytes(rng, *shape) -> np.ndarray:
    return rng.integers(0, 256, shape, dtype=np.uint8)


def verify_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tobytes() == w.tobytes(), f"dst {index} differs"


# --------------------------------------------------------------------------
# What the data path does with it
# --------------------------------------------------------------------------


def test_gather_rows_into_ring_then_scatter_back(impl):
    """Rows 2, 5, 7 of 3 layers x k/v tensors go into one layer-major ring
    region (layer, part, block) and come back into fresh tensors."""
    rng = np.random.default_rng(1)
    tensors = [rng.standard_normal((8, 32)).astype(np.float16) for _ in range(6)]
    row_bytes, block_ids = 64, [2, 5, 7]
    ring = np.zeros(4096, np.uint8)
    base = 512  # the region starts inside the ring
    gather = to_runs(
        *(
            (t, b * row_bytes, 0, base + (t * 3 + j) * row_bytes, row_bytes)
            for t in range(6)
            for j, b in enumerate(block_ids)
        )
    )
    assert native.copy_runs(tensors, [ring], gather) == 18 * row_bytes
    for t in range(6):
        for j, b in enumerate(block_ids):
            at = base + (t * 3 + j) * row_bytes
            assert ring[at : at + row_bytes].tobytes() == tensors[t][b].tobytes()
    assert not ring[:base].any()
    assert not ring[base + 18 * row_bytes :].any()

    back = [np.zeros_like(t) for t in tensors]
    scatter = gather[:, [2, 3, 0, 1, 4]]  # swap the src and dst columns
    assert native.copy_runs([ring], back, np.ascontiguousarray(scatter)) == 1152
    for t in range(6):
        assert back[t][block_ids].tobytes() == tensors[t][block_ids].tobytes()
        assert not back[t][[0, 1, 3, 4, 6]].any()


def test_many_small_runs(impl):
    rng = np.random.default_rng(2)
    srcs = [random_bytes(rng, 5000) for _ in range(3)]
    sizes = rng.integers(0, 17, 2000)
    dst_offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = [
        (int(rng.integers(3)), int(rng.integers(0, 5000 - n)), 0, int(off), int(n))
        for n, off in zip(sizes, dst_offs, strict=True)
    ]
    runs = to_runs(*rows)
    got, want = (
        [np.zeros(int(sizes.sum()), np.uint8)],
        [np.zeros(int(sizes.sum()), np.uint8)],
    )
    assert native.copy_runs(srcs, got, runs) == reference_copy(srcs, want, runs)
    verify_same(got, want)


def test_blocks_from_paged_buffer(impl):
    """A paged KV buffer [pages, k/v, page_bytes]: block ids 5, 1, 9 gathered
    with strided offsets, k then v of each block, into one staging buffer."""
    rng = np.random.default_rng(3)
    pages, page_bytes = 12, 256
    paged = random_bytes(rng, pages, 2, page_bytes)
    block_ids = [5, 1, 9]
    runs = to_runs(
        *(
            (0, (b * 2 + kv) * page_bytes, 0, (j * 2 + kv) * page_bytes, page_bytes)
            for j, b in enumerate(block_ids)
            for kv in range(2)
        )
    )
    staging = np.zeros((3, 2, page_bytes), np.uint8)
    assert native.copy_runs([paged], [staging], runs) == 6 * page_bytes
    assert staging.tobytes() == paged[block_ids].tobytes()


def test_zero_length_runs(impl):
    src, dst = bytes(range(10)), bytearray(10)
    runs = to_runs((0, 10, 0, 10, 0), (0, 0, 0, 3, 0), (1, 0, 1, 0, 0))
    assert native.copy_runs([src, b""], [dst, bytearray()], runs) == 0
    assert dst == bytearray(10)
    assert native.copy_runs([], [], to_runs()) == 0


def test_overlapping_run_behaves_as_memmove(impl):
    """A run may overlap itself (compaction inside one buffer), both ways, and
    a threaded call with such a run still gives memmove's bytes."""
    rng = np.random.default_rng(4)
    for size, shift, threads in [(100, 7, 1), (6 * MiB, MiB + 3, 4)]:
        for src_off, dst_off in [(0, shift), (shift, 0)]:
            buf = random_bytes(rng, size)
            want = bytearray(buf.tobytes())
            runs = to_runs((0, src_off, 0, dst_off, size - shift))
            reference_copy([want], [want], runs)
            native.copy_runs([buf], [buf], runs, threads=threads)
            assert buf.tobytes() == want


# --------------------------------------------------------------------------
# Refusals: checked before any byte moves, one ValueError each
# --------------------------------------------------------------------------

GOOD = (0, 0, 0, 0, 4)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ((0, 0, 0, 0, -1), "run 1 has nbytes -1, expected >= 0"),
        ((2, 0, 0, 0, 1), r"run 1 has src_index 2, expected 0 <= src_index < 2"),
        ((-1, 0, 0, 0, 1), r"run 1 has src_index -1"),
        ((0, 0, 1, 0, 1), r"run 1 has dst_index 1, expected 0 <= dst_index < 1"),
        ((0, -1, 0, 0, 1), r"run 1 has src 0 offset -1 \+ nbytes 1, expected within"),
        (
            (1, 5, 0, 0, 4),
            r"run 1 has src 1 offset 5 \+ nbytes 4, expected within "
            r"that src's 8 bytes",
        ),
        ((0, 17, 0, 0, 0), r"run 1 has src 0 offset 17 \+ nbytes 0"),
        (
            (0, 0, 0, 13, 4),
            r"run 1 has dst 0 offset 13 \+ nbytes 4, expected within "
            r"that dst's 16 bytes",
        ),
        ((0, 2**62, 0, 0, 2**62), r"run 1 has src 0 offset 4611686018427387904"),
        (
            (0, 1, 0, 1, 2**63 - 1),
            r"run 1 has src 0 offset 1 \+ nbytes 9223372036854775807",
        ),
        ((0, 0, 0, -(2**63), 1), r"run 1 has dst 0 offset -9223372036854775808"),
    ],
)
def test_out_of_bounds_run_copies_nothing(impl, bad, match):
    srcs = [bytes(range(1, 17)), bytes(8)]
    dst = np.full(16, 0xAB, np.uint8)
    with pytest.raises(ValueError, match=match):
        native.copy_runs(srcs, [dst], to_runs(GOOD, bad, GOOD))
    assert (dst == 0xAB).all()


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        (
            np.zeros((1, 5), np.float64),
            r"format 'd' and itemsize 8, expected native int64",
        ),
        (np.zeros((1, 5), np.int32), r"format 'i' and itemsize 4"),
        (np.zeros((1, 5), np.uint64), r"format 'L' and itemsize 8"),
        (np.zeros((1, 5), ">i8"), r"format '>q'"),
        (np.zeros(5, np.int64), r"runs has 1 dimensions, expected shape \[k, 5\]"),
        (np.zeros((1, 5, 1), np.int64), r"runs has 3 dimensions"),
        (np.zeros((2, 4), np.int64), r"runs has 4 columns, expected shape \[k, 5\]"),
        (np.zeros((2, 10), np.int64)[:, :5], r"runs is not C-contiguous"),
        (np.zeros((5, 2), np.int64).T, r"runs is not C-contiguous"),
    ],
)
def test_bad_runs_array_raises(impl, runs, match):
    dst = bytearray(8)
    with pytest.raises(ValueError, match=match):
        native.copy_runs([bytes(8)], [dst], runs)
    assert dst == bytearray(8)


def test_bad_buffers_and_arguments_raise(impl):
    runs = to_runs(GOOD)
    frozen = np.zeros(8, np.uint8)
    frozen.flags.writeable = False
    for dst in (bytes(8), frozen):
        with pytest.raises(ValueError, match="dst 0 is not a writable C-contiguous"):
            native.copy_runs([bytes(8)], [dst], runs)
    strided = np.zeros((4, 4), np.uint8)[:, ::2]
    with pytest.raises(ValueError, match="src 1 is not a C-contiguous buffer"):
        native.copy_runs([bytes(8), strided], [bytearray(8)], runs)
    with pytest.raises(ValueError, match="dst 0 is not a writable C-contiguous"):
        native.copy_runs([bytes(8)], [np.zeros((4, 4), np.uint8)[:, ::2]], runs)
    with pytest.raises(TypeError):
        native.copy_runs([bytes(8), 3], [bytearray(8)], runs)  # not a buffer
    with pytest.raises(TypeError, match="srcs must be a sequence"):
        native.copy_runs(3, [bytearray(8)], runs)
    with pytest.raises(TypeError):
        native.copy_runs([bytes(8)], [bytearray(8)], [[0, 0, 0, 0, 4]])
    for threads in (-1, 65):
        with pytest.raises(ValueError, match=f"threads is {threads}, expected 0"):
            native.copy_runs([bytes(8)], [bytearray(8)], runs, threads=threads)


def test_buffers_are_released_on_every_path(impl):
    """A bytearray cannot resize while exported: after calls failing at each
    stage (and one succeeding), nothing may still hold it."""
    ba = bytearray(16)
    strided = np.zeros((4, 4), np.uint8)[:, ::2]
    calls = [
        ([ba], [ba], to_runs(GOOD)),
        ([ba], [ba], ba),  # runs of format 'B'
        ([ba], [ba], np.zeros((1, 4), np.int64)),
        ([ba, strided], [ba], to_runs(GOOD)),  # after src 0 was taken
        ([ba], [ba, b"read-only"], to_runs(GOOD)),
        ([ba], [ba], to_runs(GOOD, (0, 0, 0, 20, 1))),
    ]
    for srcs, dsts, runs in calls:
        with contextlib.suppress(ValueError):
            native.copy_runs(srcs, dsts, runs)
    ba.extend(b"x")  # BufferError if an export were left


# --------------------------------------------------------------------------
# The threaded path and concurrency
# --------------------------------------------------------------------------


def test_threaded_copy_matches_one_thread(impl):
    """Above _COPY_THREAD_MINSIZE the bytes are cut into shares, splitting big
    runs: every thread count gives the same bytes, zero-length runs included."""
    rng = np.random.default_rng(5)
    srcs = [random_bytes(rng, 5 * MiB + 13), random_bytes(rng, 3 * MiB)]
    rows, at = [], 0
    for src_idx, src_off, nbytes in [
        (0, 0, 5 * MiB + 13),
        (1, 7, 0),
        (1, 1, 1),
        (1, 2, 3 * MiB - 2),
        (0, 99, 4097),
    ] + [(1, int(o), 333) for o in rng.integers(0, 3 * MiB - 333, 300)]:
        rows.append((src_idx, src_off, 0, at, nbytes))
        at += nbytes
    runs = to_runs(*rows)
    assert at >= THREAD_MINSIZE
    results = []
    for threads in (1, 2, 3, 4, None):
        dst = np.zeros(at + 5, np.uint8)
        assert native.copy_runs(srcs, [dst], runs, threads=threads) == at
        results.append(dst)
    want = [np.zeros(at + 5, np.uint8)]
    reference_copy(srcs, want, runs)
    for dst in results:
        verify_same([dst], want)


THREAD_SAFETY_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import numpy as np
    from npukv_store import native

    sys.setswitchinterval(1e-6)
    size = 6 << 20
    barrier = threading.Barrier(2)
    failures = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        src = rng.integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros(size, np.uint8)
        half = size // 2
        runs = np.array([[0, half, 0, 0, half], [0, 0, 0, half, half]], np.int64)
        barrier.wait()
        for _ in range(20):
            dst[:] = 0
            native.copy_runs([src], [dst], runs, threads=2)
            if not (np.array_equal(dst[:half], src[half:])
                    and np.array_equal(dst[half:], src[:half])):
                failures.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("failures", failures)
    """
)


def test_concurrent_copies_from_python_threads(impl):
    """Two Python threads copy at once (GIL released, each spawning its own
    copy threads); in a subprocess so a deadlock fails instead of hanging."""
    env = {**os.environ, "NPUKV_NATIVE": "0" if impl == "twin" else "1"}
    out = subprocess.run(
        [sys.executable, "-c", THREAD_SAFETY_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "failures []"


# --------------------------------------------------------------------------
# Property: any in-bounds runs give the plain loop's bytes
# --------------------------------------------------------------------------


@st.composite
def buffers_and_runs(draw):
    """A pool of buffers; srcs and dsts pick from it (a dst may also be a src,
    so runs can read what earlier runs wrote), then in-bounds runs."""
    pool_sizes = draw(st.lists(st.integers(0, 300), min_size=1, max_size=5))
    src_ids = draw(st.lists(st.integers(0, len(pool_sizes) - 1), max_size=4))
    dst_ids = draw(
        st.lists(st.integers(0, len(pool_sizes) - 1), min_size=1, max_size=3)
    )
    rows = []
    if src_ids:
        for _ in range(draw(st.integers(0, 40))):
            s = draw(st.integers(0, len(src_ids) - 1))
            d = draw(st.integers(0, len(dst_ids) - 1))
            s_len, d_len = pool_sizes[src_ids[s]], pool_sizes[dst_ids[d]]
            n = draw(st.integers(0, min(s_len, d_len)))
            rows.append(
                (
                    s,
                    draw(st.integers(0, s_len - n)),
                    d,
                    draw(st.integers(0, d_len - n)),
                    n,
                )
            )
    seed = draw(st.integers(0, 2**32 - 1))
    return pool_sizes, src_ids, dst_ids, rows, seed


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=buffers_and_runs())
def test_random_runs_match_reference_loop(impl, case):
    pool_sizes, src_ids, dst_ids, rows, seed = case
    rng = np.random.default_rng(seed)
    pool = [random_bytes(rng, size) for size in pool_sizes]
    model = [bytearray(buf.tobytes()) for buf in pool]
    runs = to_runs(*rows)
    got = native.copy_runs([pool[i] for i in src_ids], [pool[i] for i in dst_ids], runs)
    want = reference_copy(
        [model[i] for i in src_ids], [model[i] for i in dst_ids], runs
    )
    assert got == want
    verify_same(pool, [np.frombuffer(m, np.uint8) for m in model])


GRANULE = MiB  # native/copy.c NKV_COPY_GRANULE_BYTES: threads take turns


@st.composite
def threaded_layouts(draw):
    """Runs adding up past the thread threshold: zero-length runs, single bytes,
    runs ending exactly on a granule boundary or one byte either side of it,
    and runs longer than a granule; each lands at a fresh destination offset
    after a random gap, so no two runs' destinations overlap."""
    near = st.sampled_from([GRANULE - 1, GRANULE, GRANULE + 1, 3 * GRANULE + 7])
    size = st.one_of(st.just(0), st.integers(1, 4096), st.integers(1, 600_000), near)
    sizes = draw(st.lists(size, min_size=1, max_size=40))
    while sum(sizes) < THREAD_MINSIZE:
        sizes.append(draw(near))
    gaps = draw(st.lists(st.integers(0, 64), min_size=len(sizes), max_size=len(sizes)))
    threads = draw(st.integers(2, 5))
    return sizes, gaps, threads, draw(st.integers(0, 2**32 - 1))


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=threaded_layouts())
@needs_native
def test_threaded_runs_match_reference_loop(hash_kernel, case):
    """The threaded path (granules taken in turn, a run found by its offset in
    the call; streamed with the avx2 kernel, memmove with the baseline) copies
    exactly what the in-order loop copies, and nothing else."""
    sizes, gaps, threads, seed = case
    rng = np.random.default_rng(seed)
    src = random_bytes(rng, 4 * GRANULE + 64)
    rows, at = [], 0
    for size, gap in zip(sizes, gaps, strict=True):
        at += gap
        rows.append((0, int(rng.integers(0, src.size - size + 1)), 0, at, size))
        at += size
    runs = to_runs(*rows)
    dst = random_bytes(rng, at + 9)
    want = dst.copy()
    assert native.copy_runs([src], [dst], runs, threads=threads) == sum(sizes)
    reference_copy([src], [want], runs)
    verify_same([dst], [want])
