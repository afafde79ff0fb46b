"""The C extension and its pure-Python twin (NPUKV_NATIVE=0) pass the same tests."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from npukv_store import native


def test_extension_is_built_with_the_expected_abi():
    from npukv_store import _native

    assert _native.ABI_VERSION == native.ABI_VERSION
    assert native.IS_NATIVE
    assert _native._GIL_MINSIZE > 0


@pytest.fixture(params=["native", "twin"])
def impl(request, monkeypatch):
    if request.param == "twin":
        monkeypatch.setattr(native, "IMPL", None)
    return request.param


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


def test_page_residency(impl, tmp_path):
    page = os.sysconf("SC_PAGESIZE")
    path = tmp_path / "f"
    path.write_bytes(os.urandom(16 * page))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if native.page_residency(fd, 0, 16 * page).any():
            pytest.skip(f"{tmp_path} keeps file pages resident (tmpfs?)")
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


def test_env_selects_the_twin():
    code = "from npukv_store import native; print(native.IS_NATIVE)"
    env = {**os.environ, "NPUKV_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "False"


def test_xxh3_rows_matches_python_xxhash(impl):
    import numpy as np
    import xxhash

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


def test_native_checksums_are_always_built():
    """xxhash.h ships in native/third_party, so every build has the GIL-free
    checksums (built without it, the H200 host's warm reads ran 3.5x slower on
    the Python twin); a silent fallback would hide a slow verify path."""
    from npukv_store import _native

    assert hasattr(_native, "xxh3_rows")
    assert hasattr(_native, "pread_rows_xxh3")
