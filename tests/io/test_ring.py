"""The staging ring: reserve/release sequences against a model (hypothesis),
wrap-around, a full ring that refuses instead of waiting, interleaved producer
and consumer threads, the shared header, and stale-ring cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from npukv_store.errors import BadMagic
from npukv_store.io.ring import (
    ALIGN,
    StagingRing,
    read_ring_header,
    remove_stale_rings,
)

PAGES = 16


@pytest.fixture
def ring(tmp_path):
    handle = StagingRing(PAGES * ALIGN, directory=str(tmp_path))
    yield handle
    handle.close()


def test_fifo_and_wrap_around(ring):
    a = ring.reserve(6 * ALIGN)
    b = ring.reserve(6 * ALIGN)
    assert (a.offset, b.offset) == (0, 6 * ALIGN)
    assert ring.reserve(5 * ALIGN) is None  # 4 pages left at the top
    ring.release(a)
    c = ring.reserve(5 * ALIGN)  # wraps to the bottom
    assert c.offset == 0
    assert ring.reserve(2 * ALIGN) is None  # only [5, 6) pages free below b
    ring.release(b)
    ring.release(c)
    assert ring.live_regions == 0
    assert ring.reserve(PAGES * ALIGN).offset == 0  # empty ring: all of it


def test_out_of_order_release_reclaims_in_fifo_order(ring):
    a, b = ring.reserve(8 * ALIGN), ring.reserve(8 * ALIGN)
    ring.release(b)
    assert ring.reserve(ALIGN) is None  # a still holds the bottom
    ring.release(a)
    assert ring.reserve(PAGES * ALIGN) is not None
    with pytest.raises(ValueError, match="released twice"):
        ring.release(a)


def test_full_ring_refuses_at_once_and_counts(ring):
    assert ring.reserve(PAGES * ALIGN) is not None
    assert ring.reserve(1) is None
    assert ring.full_count == 1
    assert ring.reserve(PAGES * ALIGN + 1) is None  # larger than the ring
    with pytest.raises(ValueError, match="expected > 0"):
        ring.reserve(0)


def test_header_and_unlink_on_close(tmp_path):
    ring = StagingRing(3 * ALIGN + 1, directory=str(tmp_path))
    assert read_ring_header(ring.path) == (4 * ALIGN, os.getpid())
    ring.close()
    ring.close()  # idempotent
    assert not os.path.exists(ring.path)
    bogus = tmp_path / "npukv-ring-1-x"
    bogus.write_bytes(b"garbage" * 10)
    with pytest.raises(BadMagic, match="not an npukv ring"):
        read_ring_header(str(bogus))


def test_stale_rings_of_dead_processes_are_removed(tmp_path):
    code = (
        "from npukv_store.io.ring import StagingRing;"
        f"r = StagingRing(4096, directory={str(tmp_path)!r}); print(r.path)"
    )  # exits without close(): as if killed
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    dead = out.stdout.strip()
    assert os.path.exists(dead)
    live = StagingRing(ALIGN, directory=str(tmp_path))  # creating one cleans up
    assert not os.path.exists(dead)
    assert os.path.exists(live.path)
    assert remove_stale_rings(str(tmp_path)) == 0  # we are alive
    live.close()


def test_interleaved_producer_and_consumer_threads(ring):
    """A producer fills regions with a per-batch pattern while a consumer checks
    and releases them FIFO; bytes are never overwritten while live."""
    sys.setswitchinterval(1e-6)
    queue: list = []
    cond = threading.Condition()
    errors: list[str] = []
    done = threading.Event()

    def consumer():
        while not (done.is_set() and not queue):
            with cond:
                while not queue and not done.is_set():
                    cond.wait(0.01)
                if not queue:
                    continue
                region, value = queue.pop(0)
            if not np.all(ring.view(region) == value):
                errors.append(f"region {region.seq} overwritten")
            ring.release(region)

    thread = threading.Thread(target=consumer)
    thread.start()
    dropped = 0
    try:
        rng = np.random.default_rng(1)
        for batch in range(2000):
            region = ring.reserve(int(rng.integers(1, 5 * ALIGN)))
            if region is None:
                dropped += 1
                continue
            ring.view(region)[:] = batch % 251
            with cond:
                queue.append((region, batch % 251))
                cond.notify()
    finally:
        done.set()
        thread.join(30)
        sys.setswitchinterval(0.005)
    assert errors == []
    assert ring.live_regions == 0
    assert ring.reserved_count + dropped == 2000


class RingMachine(RuleBasedStateMachine):
    """Model: the live regions in FIFO order with their fill bytes. Checks that
    regions never overlap, stay in bounds, keep their bytes until released, and
    that a refusal only happens when no contiguous free range could fit."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="npukv-ring-test-")
        self.ring = StagingRing(PAGES * ALIGN, directory=self.dir)
        self.live: list = []  # (region, fill) in reserve order
        self.fill = 0

    def teardown(self) -> None:
        self.ring.close()
        os.rmdir(self.dir)

    @rule(pages=st.integers(1, PAGES + 1), extra=st.integers(0, ALIGN - 1))
    def reserve(self, pages, extra):
        nbytes = (pages - 1) * ALIGN + extra + 1
        region = self.ring.reserve(nbytes)
        if region is None:
            assert not self._could_fit(-(-nbytes // ALIGN) * ALIGN)
            return
        assert region.nbytes >= nbytes
        assert region.offset >= 0
        assert region.offset + region.nbytes <= self.ring.size
        self.fill = (self.fill + 1) % 256
        self.ring.view(region)[:] = self.fill
        self.live.append((region, self.fill))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def release(self, index):
        region, fill = self.live.pop(index % len(self.live))
        assert np.all(self.ring.view(region) == fill)
        self.ring.release(region)

    def _could_fit(self, size: int) -> bool:
        """Occupancy brute force: FIFO places the next region at head or, on a
        wrap, at 0; refusing is right only if neither range is free of every
        unreclaimed region (released-out-of-order ones still occupy)."""
        taken = [(r.offset, r.offset + r.nbytes) for r in self.ring._live]

        def free(start: int) -> bool:
            end = start + size
            return end <= self.ring.size and all(
                e <= start or b >= end for b, e in taken
            )

        return free(self.ring._head) or free(0)

    @invariant()
    def no_overlap(self):
        spans = sorted((r.offset, r.offset + r.nbytes) for r, _ in self.live)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = settings(max_examples=60, stateful_step_count=40)


def test_ring_larger_than_its_filesystem_is_a_clear_error(tmp_path):
    """posix_fallocate reserves the pages up front: on tmpfs a ring that does
    not fit would otherwise SIGBUS the process on first touch."""
    from npukv_store.errors import ConfigError

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(ConfigError, match="ring_size: found .* expected a smaller"):
        StagingRing(free + (1 << 30), directory=str(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("npukv-ring-")]
