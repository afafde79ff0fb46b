"""Auto-sized staging rings (ring_size: 0) in a small /dev/shm: a smaller ring
and one warning line, never a silent stop; an explicit ring_size is made as it
is or refused; what a step stages and the batches a small ring can hold; and
a worker in a container-sized /dev/shm still saves."""

from __future__ import annotations

import errno
import logging
import os
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.errors import ConfigError
from npukv_store.io import ring as ring_mod
from npukv_store.io import ring_sizing
from npukv_store.io.ring import ALIGN, RingNoRoom
from npukv_store.io.ring_sizing import RingRequest, fitted_size, open_ring
from npukv_store.store.sizing import (
    RING_AUTO_MAX,
    RING_AUTO_MIN,
    STEPS_STAGED,
    blocks_per_chunk,
    chunk_file_bytes,
    ring_request,
    save_batch_target,
    step_stage_bytes,
)
from tests.support.blocks import tiny_spec

MIB = 1 << 20
SHM = 64 * MIB  # what docker gives a container's /dev/shm by default


def _rings(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(ring_mod.NAME_PREFIX)]


def _mount_tmpfs(directory: str) -> bool:
    command = ["mount", "-t", "tmpfs", "-o", f"size={SHM}", "tmpfs", directory]
    try:
        return subprocess.run(command, capture_output=True).returncode == 0
    except OSError:  # no mount(8) here
        return False


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A 64 MiB /dev/shm: a real tmpfs where this user may mount one, else a
    directory whose statvfs and fallocate say the same."""
    directory = tmp_path / "shm"
    directory.mkdir()
    mounted = os.geteuid() == 0 and _mount_tmpfs(str(directory))
    if not mounted:
        real_statvfs = os.statvfs

        def used() -> int:
            return sum(os.path.getsize(directory / n) for n in _rings(directory))

        def statvfs(path):
            if os.path.realpath(path) != str(directory):
                return real_statvfs(path)
            free = (SHM - used()) // ALIGN
            return os.statvfs_result(
                (ALIGN, ALIGN, SHM // ALIGN, free, free, 0, 0, 0, 0, 255)
            )

        real_fallocate = os.posix_fallocate

        def fallocate(fd, offset, length):
            if offset + length > SHM - used():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fallocate(fd, offset, length)

        monkeypatch.setattr(ring_sizing.os, "statvfs", statvfs)
        monkeypatch.setattr(ring_mod.os, "posix_fallocate", fallocate)
        monkeypatch.setattr(ring_mod.shutil, "disk_usage", lambda p: os.statvfs(p))
    yield str(directory)
    if mounted:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_auto_ring_shrinks_to_a_small_shm_with_one_line(small_shm, caplog):
    with caplog.at_level(logging.INFO, logger="npukv_store"):
        ring = open_ring(0, RingRequest(wanted=1 << 30), directory=small_shm)
    try:
        assert MIB <= ring.size <= SHM * ring_sizing.SHM_SHARE
        region = ring.reserve(ring.size)  # all of it is usable
        assert region is not None
        assert region.nbytes == ring.size
        lines = _warnings(caplog)
        assert len(lines) == 1, lines
        for wanted in ("ring_size", "--shm-size", str(ring.size), str(1 << 30)):
            assert wanted in lines[0], lines
    finally:
        ring.close()


def test_auto_ring_that_fits_is_the_wanted_size_silently(small_shm, caplog):
    with caplog.at_level(logging.INFO, logger="npukv_store"):
        ring = open_ring(0, RingRequest(wanted=4 * MIB), directory=small_shm)
    ring.close()
    assert ring.size == 4 * MIB
    assert _warnings(caplog) == []


def test_rings_of_sharers_all_fit_together(small_shm):
    request = RingRequest(wanted=1 << 30, floor=MIB, sharers=4)
    rings = [open_ring(0, request, directory=small_shm) for _ in range(4)]
    try:
        assert all(r.size <= SHM * ring_sizing.SHM_SHARE / 4 for r in rings)
        assert len(_rings(small_shm)) == 4
    finally:
        for ring in rings:
            ring.close()


def test_refused_creation_halves_down_to_what_fits(small_shm, monkeypatch, caplog):
    """statvfs can say there is room that fallocate then refuses (a memory
    cgroup, another process filling the tmpfs meanwhile): halve and retry."""
    real = ring_mod.os.posix_fallocate

    def refuse_large(fd, offset, length):
        if length > 3 * MIB:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        real(fd, offset, length)

    monkeypatch.setattr(ring_mod.os, "posix_fallocate", refuse_large)
    with caplog.at_level(logging.INFO, logger="npukv_store"):
        ring = open_ring(0, RingRequest(wanted=16 * MIB), directory=small_shm)
    try:
        assert 1 * MIB <= ring.size <= 3 * MIB
        assert _rings(small_shm) == [os.path.basename(ring.path)]  # no leftovers
        lines = _warnings(caplog)
        assert len(lines) == 1, lines
        assert "ring_size" in lines[0], lines
    finally:
        ring.close()


def test_auto_ring_below_its_floor_is_one_error_naming_what_to_set(small_shm):
    request = RingRequest(wanted=1 << 30, floor=SHM * 2)
    with pytest.raises(RingNoRoom) as caught:
        open_ring(0, request, directory=small_shm)
    message = str(caught.value)
    assert "ring_size" in message, message
    assert "--shm-size" in message, message
    assert _rings(small_shm) == []


def test_explicit_ring_size_is_never_shrunk(small_shm):
    with pytest.raises(ConfigError, match="ring_size: found"):
        open_ring(2 * SHM, RingRequest(wanted=MIB), directory=small_shm)
    ring = open_ring(5 * MIB, RingRequest(wanted=MIB), directory=small_shm)
    ring.close()
    assert ring.size == 5 * MIB
    assert _rings(small_shm) == []


@settings(max_examples=200, deadline=None)
@given(
    wanted=st.integers(ALIGN, 1 << 40),
    total=st.integers(1, 1 << 28).map(lambda pages: pages * ALIGN),
    used=st.floats(0, 1),
    sharers=st.integers(1, 64),
)
def test_fitted_size_never_exceeds_the_share_or_the_free_room(
    wanted, total, used, sharers
):
    free_pages = int(total // ALIGN * (1 - used))
    info = os.statvfs_result(
        (ALIGN, ALIGN, total // ALIGN, free_pages, free_pages, 0, 0, 0, 0, 255)
    )
    real = ring_sizing.os.statvfs
    ring_sizing.os.statvfs = lambda path: info  # type: ignore[assignment]
    try:
        size, why = fitted_size(RingRequest(wanted, ALIGN, sharers), "/x")
    finally:
        ring_sizing.os.statvfs = real  # type: ignore[assignment]
    free = free_pages * ALIGN
    share = int(total * ring_sizing.SHM_SHARE) // sharers
    if wanted <= min(share, free - ring_mod.HEADER_BYTES):
        assert (size, why) == (wanted, "")
    else:
        assert size % ALIGN == 0
        assert ALIGN <= size <= wanted  # a page at least, even in a full fs
        assert size <= max(ALIGN, min(share, free))
        assert why


# -- what a step stages -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(1, 4096),
    block_size=st.sampled_from([1, 16, 128]),
    tokens=st.integers(1, 1 << 15),
    target=st.integers(1, 256 * MIB),
)
def test_a_step_stages_its_blocks_cut_as_the_saver_cuts_them(
    width, block_size, tokens, target
):
    spec = tiny_spec(block_size=block_size, row_shape=(width,))
    blocks = -(-tokens // block_size)
    step = step_stage_bytes([spec], tokens, target)
    per_chunk = blocks_per_chunk(spec.block_bytes, target)
    batches = -(-blocks // per_chunk)
    assert step >= blocks * spec.block_bytes + batches * ALIGN  # data + headers
    assert step % ALIGN == 0
    assert step <= batches * (chunk_file_bytes(spec, per_chunk) + ALIGN)
    request = ring_request([spec], tokens, target)
    expected = min(max(STEPS_STAGED * step, RING_AUTO_MIN), RING_AUTO_MAX)
    assert request.wanted == max(expected, request.floor)
    assert request.floor >= STEPS_STAGED * chunk_file_bytes(spec, 1)


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(1, 1 << 16),
    ring_pages=st.integers(1, 1 << 14),
    target=st.integers(1, 256 * MIB),
)
def test_save_batches_fit_the_ring_twice(width, ring_pages, target):
    spec = tiny_spec(row_shape=(width,))
    ring_bytes = ring_pages * ALIGN
    batch = save_batch_target([spec], target, ring_bytes)
    assert batch <= target
    n = blocks_per_chunk(spec.block_bytes, batch)
    one_block = -(-chunk_file_bytes(spec, 1) // ALIGN) * ALIGN
    if STEPS_STAGED * one_block <= ring_bytes:  # else nothing could fit
        aligned = -(-chunk_file_bytes(spec, n) // ALIGN) * ALIGN
        assert STEPS_STAGED * aligned <= ring_bytes
    if (
        STEPS_STAGED
        * chunk_file_bytes(spec, blocks_per_chunk(spec.block_bytes, target))
        + (2 * ALIGN)
        <= ring_bytes
    ):
        assert batch == target  # a ring with room keeps the configured chunks


# -- a worker in a container-sized /dev/shm ---------------------------------------


def test_worker_in_a_tiny_shm_saves_in_smaller_batches(tmp_path, monkeypatch, caplog):
    """An auto ring far below what a step wants: one warning line, and the
    step's blocks still saved, in batches the ring holds (without the smaller
    batches, one batch larger than the ring would drop every block)."""
    pytest.importorskip("torch")
    pytest.importorskip("vllm", reason="the connector needs vLLM")
    from npukv_store import StoreConfig
    from npukv_store.connector.metadata import NPUKVMetadata
    from npukv_store.connector.worker.side import WorkerSide
    from tests.support.connector import cpu_caches, engine_config, transfer
    from tests.support.faults import keys_for

    real = os.statvfs
    tiny = 256 << 10  # the rings' share: 128 KiB, a 30-block step is ~190 KiB

    def statvfs(path):
        if path != "/dev/shm":
            return real(path)
        pages = tiny // ALIGN
        return os.statvfs_result((ALIGN, ALIGN, pages, pages, pages, 0, 0, 0, 0, 255))

    monkeypatch.setattr(ring_sizing.os, "statvfs", statvfs)
    cfg = StoreConfig(cache_dir=str(tmp_path / "c"), ring_size=0)
    with caplog.at_level(logging.INFO, logger="npukv_store"):
        worker = WorkerSide(*engine_config(), cfg)
        worker.register(cpu_caches(seed=1))
        try:
            assert not worker.disabled_reason, worker.disabled_reason
            assert worker.store is not None
            ring_bytes = worker.store.ring_buffer().nbytes
            assert ring_bytes <= tiny // 2
            keys = keys_for("tiny-shm", 30)
            worker.bind(NPUKVMetadata(saves=[transfer(keys, list(range(1, 31)))]))
            worker.start_load()
            worker.finish_step()
            assert worker.store.flush(30)
            stats = worker.take_stats()
            assert stats is not None
            saved = stats.data["saved_blocks"]
            assert saved > 0, stats.data
            assert worker.store.lookup(keys[:saved]) > 0
        finally:
            worker.close()
    lines = [m for m in _warnings(caplog) if "staging ring" in m]
    assert len(lines) == 1, _warnings(caplog)
    assert "--shm-size" in lines[0], lines
