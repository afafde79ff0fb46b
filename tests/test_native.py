"""The C extension and its pure-Python twin (NPUKV_NATIVE=0) pass the same tests;
native.py binds one of them at import, and refuses a missing or stale build.

The ``impl`` fixtures run a test on both in one process by binding the twin's
functions where NPUKV_NATIVE=0 would; scripts/test.sh also runs this file
with NPUKV_NATIVE=0, where the native cases skip."""

from __future__ import annotations

import errno
import inspect
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npukv_store import _twin, native

#: the entry points native.py binds once, each to ``_<name>``
BOUND = [
    "sync_file_range",
    "page_residency",
    "cached_pages",
    "xxh3_rows",
    "pread_rows_xxh3",
    "pread_layers_xxh3",
    "copy_runs",
    "copy_ptrs",
]
needs_native = pytest.mark.skipif(
    not native.IS_NATIVE, reason="NPUKV_NATIVE=0: the C extension is not in use"
)
REPO = pathlib.Path(__file__).resolve().parents[1]


def per_param_settings(examples: int) -> settings:
    """Hypothesis settings for tests whose parametrized fixture picks an
    implementation once per parameter, for all of that parameter's examples."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


def use_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bind the twin's entry points in this process, as NPUKV_NATIVE=0 does at
    import (IMPL is left alone: the device calls and Uring have no twin)."""
    for name in BOUND:
        monkeypatch.setattr(native, f"_{name}", getattr(_twin, name))


@pytest.fixture(params=["native", "twin"])
def impl(request, monkeypatch):
    if request.param == "twin":
        use_twin(monkeypatch)
    elif not native.IS_NATIVE:
        pytest.skip("NPUKV_NATIVE=0: the C extension is not in use")
    return request.param


@needs_native
def test_extension_is_built_with_the_expected_abi():
    from npukv_store import _native

    assert _native.ABI_VERSION == native.ABI_VERSION
    assert native.IMPL is _native
    assert _native._GIL_MINSIZE > 0


def test_the_twin_binds_every_entry_point_it_has():
    """BOUND is all of the twin's public functions, and each is bound to the
    implementation picked at import: forgetting one would leave a twin
    function no process ever calls."""
    twin_functions = {
        name
        for name, value in vars(_twin).items()
        if inspect.isfunction(value)
        and value.__module__ == _twin.__name__
        and not name.startswith("_")
    }
    assert twin_functions == set(BOUND)
    picked = native.IMPL if native.IS_NATIVE else _twin
    for name in BOUND:
        assert getattr(native, f"_{name}") is getattr(picked, name), name


@needs_native
@pytest.mark.parametrize("name", BOUND)
def test_the_twin_takes_the_arguments_the_extension_takes(name):
    """Both are called the same way by native.py (the C docstrings carry text
    signatures): the same names, kinds and defaults."""

    def shape(fn):
        return [
            (p.name, p.kind, p.default)
            for p in inspect.signature(fn).parameters.values()
        ]

    assert shape(getattr(_twin, name)) == shape(getattr(native.IMPL, name))


def test_sync_file_range(impl, tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"x" * 100_000)
        native.sync_file_range_write(fd, 0, 100_000)
        native.sync_file_range_write(fd, 4096, 0)  # 0 means "to the end"
        with pytest.raises(ValueError, match=">= 0"):
            native.sync_file_range_write(fd, -1, 10)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="sync_file_range") as info:
        native.sync_file_range_write(fd, 0, 10)  # closed fd
    assert info.value.errno == errno.EBADF


def open_uncached(path, pages: int) -> int:
    """An fd on a new file of ``pages`` random pages, none of them in the page
    cache; skips the test where the filesystem keeps them (tmpfs)."""
    page = os.sysconf("SC_PAGESIZE")
    path.write_bytes(os.urandom(pages * page))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if native.page_residency(fd, 0, pages * page).any():
        os.close(fd)
        pytest.skip(f"{path.parent} keeps file pages resident (tmpfs?)")
    return fd


def test_page_residency(impl, tmp_path):
    page = os.sysconf("SC_PAGESIZE")
    fd = open_uncached(tmp_path / "f", 16)
    try:
        os.pread(fd, 2 * page, 4 * page)  # pages 4 and 5
        cached = native.page_residency(fd, 0, 16 * page)
        assert cached.dtype.name == "uint8"
        assert cached.size == 16
        assert cached[4:6].tolist() == [1, 1]
        assert cached[:4].sum() == 0
        # from the page holding the offset, to the page holding the last byte
        assert native.page_residency(fd, 4 * page + 1, page).tolist() == [1, 1]
        assert native.page_residency(fd, 3 * page, 0).size == 0
        with pytest.raises(ValueError, match=">= 0"):
            native.page_residency(fd, -1, 10)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="page_residency"):
        native.page_residency(fd, 0, page)  # closed fd


def run_python(code: str, native_env: str | None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with NPUKV_NATIVE set to ``native_env``
    (None: unset), whatever this process has."""
    env = {k: v for k, v in os.environ.items() if k != "NPUKV_NATIVE"}
    if native_env is not None:
        env["NPUKV_NATIVE"] = native_env
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


# Run before npukv_store is imported: the build is gone (an import of None in
# sys.modules fails as a missing .so does), or stale (another ABI_VERSION).
NO_BUILD = 'import sys; sys.modules["npukv_store._native"] = None\n'
STALE_BUILD = """
import sys, types
stale = types.ModuleType("npukv_store._native")
stale.ABI_VERSION = 7
stale.__file__ = "/old/_native.so"
sys.modules["npukv_store._native"] = stale
"""
IMPORT = """
try:
    import npukv_store
except ImportError as exc:
    print("ImportError:", exc)
else:
    print("imported, native:", npukv_store.native.IS_NATIVE)
"""


@pytest.mark.parametrize(
    ("build", "found"),
    [
        (NO_BUILD, "found no loadable build (import of npukv_store._native halted"),
        (STALE_BUILD, "found a stale build with ABI_VERSION 7 (/old/_native.so)"),
    ],
    ids=["missing", "stale"],
)
@pytest.mark.parametrize("native_env", [None, "1"])
def test_a_missing_or_stale_build_is_an_import_error(build, found, native_env):
    """No silent fallback to the twin (3.5x slower warm reads): importing the
    package fails with one message naming what was found, what was expected
    and both ways out."""
    out = run_python(build + IMPORT, native_env)
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert message.startswith("ImportError: npukv_store._native: " + found), message
    assert f"expected a build with ABI_VERSION {native.ABI_VERSION}" in message
    assert "`pip install -e .`" in message
    assert "set NPUKV_NATIVE=0 to use the pure-Python twin" in message
    assert out.stderr == ""  # and no warning besides


STORE_ROUND_TRIP = """
import tempfile
from npukv_store import KVStore, StoreConfig
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec
with tempfile.TemporaryDirectory() as cache_dir:
    store = KVStore(StoreConfig(cache_dir=cache_dir), tiny_spec())
    keys = store.keys_for(range(64))
    store.put(keys, block_tensors(store.spec, keys))
    assert store.read(keys, empty_blocks(store.spec, 4)) == [True] * 4
    assert store.check(verify_data=True) == []
    store.close()
print("ok")
"""


@pytest.mark.parametrize(
    "build", ["", NO_BUILD, STALE_BUILD], ids=["built", "missing", "stale"]
)
def test_only_npukv_native_0_selects_the_twin(build):
    """NPUKV_NATIVE=0 binds the twin (the C module is not even imported, so a
    missing or stale build does not matter) and a store works on it."""
    code = f"""
import sys
{build}
before = sys.modules.get("npukv_store._native")
from npukv_store import _twin, native
assert native.IMPL is None and not native.IS_NATIVE
assert all(getattr(native, "_" + n) is getattr(_twin, n) for n in {BOUND!r})
assert sys.modules.get("npukv_store._native") is before  # never imported
{STORE_ROUND_TRIP}
"""
    out = run_python(code, "0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_xxh3_rows_matches_python_xxhash(impl):
    rng = np.random.default_rng(7)
    k = rng.integers(0, 255, (5, 300), dtype=np.uint8)
    v = rng.integers(0, 255, (5, 100), dtype=np.uint8)
    sums = native.xxh3_rows([k, v], 5)
    for row in range(5):
        digest = xxhash.xxh3_64(k[row].tobytes() + v[row].tobytes()).intdigest()
        assert int(sums[row]) == digest
    big = rng.integers(0, 255, (2, 1 << 20), dtype=np.uint8)  # GIL-free path
    assert int(native.xxh3_rows([big], 2)[1]) == xxhash.xxh3_64(big[1]).intdigest()
    with pytest.raises(ValueError, match="multiple of 7 rows"):
        native.xxh3_rows([k], 7)  # 1500 bytes
    with pytest.raises(ValueError, match="expected 1..64 parts"):
        native.xxh3_rows([], 1)


def test_pread_rows_xxh3_reads_and_hashes_in_one_pass(impl, tmp_path):
    import numpy as np

    rng = np.random.default_rng(11)
    k = rng.integers(0, 255, (6, 300_000), dtype=np.uint8)  # > one 256 KiB piece
    v = rng.integers(0, 255, (6, 1000), dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(b"h" * 77 + k.tobytes() + v.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        sums = native.pread_rows_xxh3(fd, [(77, dk), (77 + k.nbytes, dv)], 6)
        np.testing.assert_array_equal(dk, k)
        np.testing.assert_array_equal(dv, v)
        np.testing.assert_array_equal(sums, native.xxh3_rows([k, v], 6))
        rk, rv = np.zeros_like(k), np.zeros_like(v)  # file rows into rows reversed
        back = native.pread_rows_xxh3(
            fd, [(77, rk, True), (77 + k.nbytes, rv, True)], 6
        )
        np.testing.assert_array_equal(rk, k[::-1])
        np.testing.assert_array_equal(rv, v[::-1])
        np.testing.assert_array_equal(back, sums)  # checksums in file row order
        with pytest.raises(OSError, match="short read") as info:
            native.pread_rows_xxh3(fd, [(78 + k.nbytes, dv)], 6)  # 1 byte past
        assert info.value.errno == errno.EIO
        with pytest.raises(ValueError, match="multiple of 7 rows"):
            native.pread_rows_xxh3(fd, [(0, dv)], 7)
        with pytest.raises(ValueError, match="offset >= 0"):
            native.pread_rows_xxh3(fd, [(-1, dv)], 6)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="pread_rows_xxh3|Bad file") as closed:
        native.pread_rows_xxh3(fd, [(0, dv)], 6)  # closed fd
    assert closed.value.errno == errno.EBADF


@pytest.fixture(params=["native", "native-mincore", "twin"])
def residency_impl(request, monkeypatch):
    """cached_pages three ways: cachestat, the native mincore fallback (what
    kernels before 6.5 and seccomp-filtered containers get), the twin."""
    if request.param == "twin":
        use_twin(monkeypatch)
        yield request.param
        return
    if not native.IS_NATIVE:
        pytest.skip("NPUKV_NATIVE=0: the C extension is not in use")
    from npukv_store import _native

    before = _native._use_cachestat()
    _native._use_cachestat(request.param == "native")
    try:
        yield request.param
    finally:
        _native._use_cachestat(before)


@per_param_settings(40)
@given(
    cached=st.lists(st.booleans(), min_size=24, max_size=24),
    ranges=st.lists(
        st.tuples(st.integers(0, 30 * 4096), st.integers(0, 12 * 4096)), max_size=12
    ),
)
def test_cached_pages_counts_what_page_residency_sees(
    residency_impl, tmp_path_factory, cached, ranges
):
    """Random pages cached, random ranges (empty ones, ones past the end of
    the file): each count equals the resident pages page_residency reports."""
    page = os.sysconf("SC_PAGESIZE")
    fd = open_uncached(tmp_path_factory.mktemp("cached") / "f", 24)
    try:
        for index, wanted in enumerate(cached):
            if wanted:
                os.pread(fd, 1, index * page)
        pairs = np.array(ranges, dtype=np.int64).reshape(-1, 2)
        counts = native.cached_pages(fd, pairs)
        assert counts.dtype == np.int64
        assert counts.shape == (len(ranges),)
        for (offset, nbytes), count in zip(ranges, counts.tolist(), strict=True):
            expected = int(native.page_residency(fd, offset, nbytes).sum()) * (
                nbytes > 0
            )
            assert count == expected, (offset, nbytes)
    finally:
        os.close(fd)


def test_cached_pages_bad_input(residency_impl, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert native.cached_pages(fd, np.zeros((0, 2), np.int64)).size == 0
        with pytest.raises(ValueError, match="range 1 has offset -5"):
            native.cached_pages(fd, np.array([[0, 10], [-5, 10]]))
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="cached_pages|page_residency|Bad file"):
        native.cached_pages(fd, np.array([[0, 4096]]))  # closed fd


@needs_native
def test_the_widest_kernel_is_picked_and_unknown_ones_refused():
    from npukv_store import _native

    kernels = _native._hash_kernels()
    assert kernels[-1] == "baseline"
    assert _native._hash_kernel() == kernels[0]
    with pytest.raises(ValueError, match="found sse9"):
        _native._hash_kernel("sse9")
    assert _native._hash_kernel() == kernels[0]


@per_param_settings(30)
@given(
    num_rows=st.integers(1, 5),
    part_row_bytes=st.lists(
        st.sampled_from([0, 1, 16, 17, 128, 129, 240, 241, 1024, 4099, 70_001]),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 2**32 - 1),
)
@needs_native
def test_every_hash_kernel_matches_python_xxhash(
    hash_kernel, tmp_path_factory, num_rows, part_row_bytes, seed
):
    """Each kernel gives python-xxhash's xxh3_64 for every input length class
    (xxh3 has separate paths up to 16, 128 and 240 bytes, then the SIMD loop),
    one-shot (xxh3_rows with one part), streamed over parts, and in
    pread_rows_xxh3's 256 KiB pieces that cut rows."""
    rng = np.random.default_rng(seed)
    parts = [
        rng.integers(0, 256, (num_rows, row), dtype=np.uint8) for row in part_row_bytes
    ]
    if sum(part_row_bytes) == 0:
        return  # nothing to hash: xxh3_rows wants whole rows of some bytes
    want = [
        xxhash.xxh3_64(b"".join(p[r].tobytes() for p in parts)).intdigest()
        for r in range(num_rows)
    ]
    assert native.xxh3_rows(parts, num_rows).tolist() == want
    path = tmp_path_factory.mktemp("kernel") / "f"
    path.write_bytes(b"".join(p.tobytes() for p in parts))
    fd = os.open(path, os.O_RDONLY)
    try:
        outs = [np.empty_like(p) for p in parts]
        offsets = np.cumsum([0] + [p.nbytes for p in parts[:-1]]).tolist()
        got = native.pread_rows_xxh3(
            fd, [(o, out) for o, out in zip(offsets, outs, strict=True)], num_rows
        )
    finally:
        os.close(fd)
    assert got.tolist() == want
    for out, part in zip(outs, parts, strict=True):
        np.testing.assert_array_equal(out, part)


@per_param_settings(25)
@given(
    num_layers=st.integers(1, 5),
    num_rows=st.integers(1, 4),
    row_bytes=st.sampled_from([8, 300, 70_001]),
    reversed_layer=st.integers(-1, 4),
)
def test_pread_layers_xxh3_is_pread_rows_xxh3_per_layer(
    impl, tmp_path_factory, num_layers, num_rows, row_bytes, reversed_layer
):
    """Layers of two parts each, one layer's parts reversed: the same bytes
    land, and each layer's digests are those of pread_rows_xxh3 alone."""
    rng = np.random.default_rng(num_layers * 100 + num_rows)
    data = rng.integers(0, 256, num_layers * 2 * num_rows * row_bytes, np.uint8)
    path = tmp_path_factory.mktemp("layers") / "f"
    path.write_bytes(data.tobytes())
    part_bytes = num_rows * row_bytes

    def layout():
        outs = [np.zeros(part_bytes, np.uint8) for _ in range(2 * num_layers)]
        layers = [
            [
                (
                    (2 * layer + p) * part_bytes,
                    outs[2 * layer + p],
                    layer == reversed_layer,
                )
                for p in range(2)
            ]
            for layer in range(num_layers)
        ]
        return outs, layers

    fd = os.open(path, os.O_RDONLY)
    try:
        outs, layers = layout()
        found = native.pread_layers_xxh3(fd, layers, num_rows)
        single_outs, single_layers = layout()
        want = [native.pread_rows_xxh3(fd, parts, num_rows) for parts in single_layers]
    finally:
        os.close(fd)
    assert found.dtype == np.uint64
    assert found.shape == (num_layers, num_rows)
    np.testing.assert_array_equal(found, np.stack(want))
    for got, expected in zip(outs, single_outs, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_pread_layers_xxh3_errors(impl, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    out = np.zeros(1024, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="found 0 layers"):
            native.pread_layers_xxh3(fd, [], 2)
        with pytest.raises(ValueError, match="multiple of 3 rows"):
            native.pread_layers_xxh3(fd, [[(0, out)]], 3)
        with pytest.raises(OSError, match="short read"):  # the 2nd layer ends early
            native.pread_layers_xxh3(fd, [[(0, out)], [(3584, out)]], 2)
    finally:
        os.close(fd)


STREAM_MIN_BYTES = native.BOUNCE_ABOVE_BYTES  # native/checksum.c NKV_STREAM_MIN_BYTES


@per_param_settings(20)
@given(
    num_rows=st.integers(1, 6),
    row_bytes=st.sampled_from(
        [1, 4095, 43_691, STREAM_MIN_BYTES // 3 + 1, 100_003, STREAM_MIN_BYTES + 33]
    ),
    misalign=st.integers(0, 63),
    reverse=st.booleans(),
)
@needs_native
def test_large_parts_stream_through_the_bounce_buffer_exactly(
    hash_kernel, tmp_path_factory, num_rows, row_bytes, misalign, reverse
):
    """Parts from NKV_STREAM_MIN_BYTES on go through an L2 bounce buffer and a
    non-temporal copy (kernels with a stream_copy), smaller ones straight into
    place: either way every destination byte is the file's, the digests are
    python-xxhash's, and the bytes either side of the destination (at any
    alignment, so the copy's head and tail run) are left as they were."""
    rng = np.random.default_rng(num_rows * 7919 + row_bytes + misalign)
    data = rng.integers(0, 256, (num_rows, row_bytes), dtype=np.uint8)
    path = tmp_path_factory.mktemp("stream") / "f"
    path.write_bytes(b"\0" * 4096 + data.tobytes())
    guard = 64
    arena = rng.integers(0, 256, misalign + data.nbytes + guard, dtype=np.uint8)
    before = arena.copy()
    dest = arena[misalign : misalign + data.nbytes]
    fd = os.open(path, os.O_RDONLY)
    try:
        found = native.pread_rows_xxh3(fd, [(4096, dest, reverse)], num_rows)
    finally:
        os.close(fd)
    want_rows = data[::-1] if reverse else data
    assert dest.tobytes() == want_rows.tobytes()
    assert found.tolist() == [xxhash.xxh3_64(row.tobytes()).intdigest() for row in data]
    np.testing.assert_array_equal(arena[:misalign], before[:misalign])
    np.testing.assert_array_equal(arena[misalign + data.nbytes :], before[-guard:])


# -- sizes whose arithmetic would overflow (security review, finding 8) --------
# Empty parts pass the multiple-of-nrows check with any nrows, and offsets or
# addresses plus lengths can pass INT64_MAX: each call below once wrapped a
# size in C (SIGSEGV, a heap overflow) or raised something else than the
# twin. tests/security/test_native.py runs the same in child processes.
INT64_MAX = 2**63 - 1
MAX_ROWS = INT64_MAX // 1024  # native/checksum.c NKV_MAX_ROWS
MAX_RUNS = INT64_MAX // 64  # native/nkv.h NKV_MAX_RUNS


def _claiming(nbytes: int, ndim: int = 1) -> np.ndarray:
    """An int64 view claiming ``nbytes`` over 40 real ones (as_strided takes
    the caller's word, as a C exporter may); the calls never read past 40."""
    base = np.zeros(5, np.int64)
    if ndim == 2:
        shape, strides = (nbytes // 40, 5), (40, 8)
    else:
        shape, strides = (nbytes // 8,), (8,)
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


#: name -> (entry point, its arguments given a readable fd, part of the message)
OVERFLOWS = {
    "xxh3_rows: an empty part of 2**61 rows": (
        "xxh3_rows", lambda fd: ([b""], 2**61), f"1..64 parts and 1..{MAX_ROWS} rows"
    ),
    "xxh3_rows: one row past the bound": (
        "xxh3_rows", lambda fd: ([b"", bytearray()], MAX_ROWS + 1), "rows"
    ),
    "pread_rows_xxh3: an empty part of 2**61 rows": (
        "pread_rows_xxh3", lambda fd: (fd, [(0, bytearray())], 2**61),
        f"found 1 layers and {2**61} rows",
    ),
    "pread_rows_xxh3: 2**55 rows (only the row states wrap)": (
        "pread_rows_xxh3", lambda fd: (fd, [(0, bytearray())], 2**55),
        f"layers * rows <= {MAX_ROWS}",
    ),
    "pread_layers_xxh3: 4 layers of 2**61 rows": (
        "pread_layers_xxh3", lambda fd: (fd, [[(0, bytearray())]] * 4, 2**61),
        "found 4 layers",
    ),
    "pread_layers_xxh3: layers x rows past the bound": (
        "pread_layers_xxh3",
        lambda fd: (fd, [[(0, bytearray())]] * 8, MAX_ROWS // 8 + 1),
        "found 8 layers",
    ),
    "pread_rows_xxh3: offset + bytes past INT64_MAX": (
        "pread_rows_xxh3", lambda fd: (fd, [(INT64_MAX - 3, bytearray(8))], 1),
        f"layer 0 part 0 has offset {INT64_MAX - 3} and 8 bytes",
    ),
    "pread_layers_xxh3: the 2nd layer's offset + bytes": (
        "pread_layers_xxh3",
        lambda fd: (fd, [[(0, bytearray(8))], [(INT64_MAX, bytearray(8))]], 1),
        "layer 1 part 0",
    ),
    "page_residency: offset + nbytes past INT64_MAX": (
        "page_residency", lambda fd: (fd, 2**62, 2**62), "offset + nbytes <="
    ),
    "cached_pages: offset + nbytes past INT64_MAX": (
        "cached_pages", lambda fd: (fd, np.array([0, 1, 2**62, 2**62], np.int64)),
        "range 1 has offset",
    ),
    "copy_runs: more runs than the bound": (
        "copy_runs", lambda fd: ([b""], [bytearray()], _claiming(INT64_MAX, 2)),
        f"rows, expected 0..{MAX_RUNS}",
    ),
    "copy_ptrs: a run count whose table size wraps": (
        "copy_ptrs",
        lambda fd: (_claiming(((2**64 + 8) // 24 - 1) * 8),) * 3,
        f"expected at most {MAX_RUNS}",
    ),
    "copy_ptrs: src + size past INT64_MAX": (
        "copy_ptrs",
        lambda fd: tuple(np.array([v], np.int64) for v in (INT64_MAX - 8, 8, 16)),
        "expected each to end at or below",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", OVERFLOWS)
def test_sizes_that_would_overflow_are_refused(impl, tmp_path, name):
    entry, arguments, message = OVERFLOWS[name]
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            getattr(native, f"_{entry}")(*arguments(fd))
    finally:
        os.close(fd)


@needs_native
def test_the_twin_refuses_overflows_with_the_extensions_messages(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, (entry, arguments, message) in OVERFLOWS.items():
            messages = []
            for module in (native.IMPL, _twin):
                with pytest.raises(ValueError, match=re.escape(message)) as info:
                    getattr(module, entry)(*arguments(fd))
                messages.append(str(info.value))
            assert messages[0] == messages[1], name
    finally:
        os.close(fd)
