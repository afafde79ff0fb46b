"""The I/O engines pass the same conformance tests, on real files.

``engine`` runs each test against io_uring (native/uring.c through io/uring.py)
and its twin, the thread pool (io/threads.py); the uring case skips, naming the
reason, where it cannot start (io_uring_setup refused, or NPUKV_NATIVE=0). The
rule where they differ on purpose: ``submit`` beyond ``queue_depth`` raises
ValueError on io_uring (the ring has that many entries) and queues on threads.
Then: make_engine's choice and fallback, ring-only behavior (buffers pinned
until reaped, threads, fork), and O_DIRECT (io/direct.py) through both engines
on a file under /var/tmp.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Any

import numpy as np
import pytest

from npukv_store import native
from npukv_store.errors import ConfigError
from npukv_store.io import direct
from npukv_store.io.engine import READ, WRITE, IOEngine, IORequest, make_engine
from npukv_store.io.uring import UringEngine

pytestmark = pytest.mark.integration

QUEUE_DEPTH = 16


def _uring_problem() -> str | None:
    try:
        UringEngine(1).close()
    except (ImportError, OSError) as exc:
        return f"io_uring cannot start here: {exc}"
    return None


URING_PROBLEM = _uring_problem()
needs_uring = pytest.mark.skipif(URING_PROBLEM is not None, reason=str(URING_PROBLEM))


def _make(kind: str, queue_depth: int = QUEUE_DEPTH) -> IOEngine:
    if kind == "uring" and URING_PROBLEM is not None:
        pytest.skip(URING_PROBLEM)
    return make_engine(kind, queue_depth)


@pytest.fixture(params=["threads", "uring"])
def engine(request):
    eng = _make(request.param)
    yield eng
    eng.close()


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def data_file(tmp_path):
    """(path, content): 1 MiB + 100 random bytes, size not block-aligned."""
    content = random_bytes(2**20 + 100)
    path = tmp_path / "data"
    path.write_bytes(content)
    return path, content


def read(fd: int, offset: int, nbytes: int, tag: int = 0) -> IORequest:
    return IORequest(READ, fd, offset, memoryview(bytearray(nbytes)), tag)


def one(engine: IOEngine, request: IORequest) -> int:
    (done,) = engine.run([request])
    assert done.tag == request.tag
    return done.result


# ---------------------------------------------------------------- conformance


def test_write_then_read_round_trip(engine, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        parts = [random_bytes(n, seed=n) for n in (1, 4096, 100_000)]
        offsets = [0, 10, 8192]
        writes = [
            IORequest(WRITE, fd, off, memoryview(p), i)
            for i, (off, p) in enumerate(zip(offsets, parts, strict=True))
        ]
        results = {c.tag: c.result for c in engine.run(writes)}
        assert results == {0: 1, 1: 4096, 2: 100_000}
        reads = [
            read(fd, off, len(p), i)
            for i, (off, p) in enumerate(zip(offsets, parts, strict=True))
        ]
        done = {c.tag: c.result for c in engine.run(reads)}
        assert done == results
        for request, part in zip(reads, parts, strict=True):
            assert bytes(request.buffer) == part
        assert engine.in_flight == 0
    finally:
        os.close(fd)


def test_vectored_requests_move_file_adjacent_ranges_of_several_buffers(
    engine, tmp_path
):
    """A tuple of buffers is one preadv/pwritev: the file range is their
    concatenation, the result the total; a short read fills them in order."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        parts = [random_bytes(n, seed=n) for n in (5000, 1, 70_000)]
        views = tuple(memoryview(p) for p in parts)
        assert one(engine, IORequest(WRITE, fd, 100, views, 0)) == 75_001
        whole = os.pread(fd, 75_001, 100)
        assert whole == b"".join(parts)
        outs = [bytearray(n) for n in (10, 70_000, 4990)]
        request = IORequest(READ, fd, 100, tuple(memoryview(o) for o in outs), 1)
        assert one(engine, request) == 75_000
        assert b"".join(outs) == whole[:75_000]
        tail = (memoryview(bytearray(2)), memoryview(bytearray(8)))
        assert one(engine, IORequest(READ, fd, 100 + 75_000 - 3, tail, 2)) == 4
        assert bytes(tail[0]) + bytes(tail[1][:2]) == whole[-4:]
        assert engine.in_flight == 0
    finally:
        os.close(fd)


def test_short_read_at_eof_returns_the_short_count(engine, data_file):
    path, content = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        request = read(fd, len(content) - 300, 4096)
        assert one(engine, request) == 300
        assert bytes(request.buffer[:300]) == content[-300:]
    finally:
        os.close(fd)


def test_read_past_eof_returns_zero(engine, data_file):
    path, content = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        assert one(engine, read(fd, len(content), 4096)) == 0
        assert one(engine, read(fd, len(content) + 2**20, 10)) == 0
    finally:
        os.close(fd)


def test_bad_fd_gives_ebadf(engine, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    os.close(fd)  # nothing opens files meanwhile, so the number stays unused
    assert one(engine, read(fd, 0, 10)) == -errno.EBADF
    assert one(engine, read(-1, 0, 10)) == -errno.EBADF


def test_write_to_read_only_fd_gives_ebadf(engine, data_file):
    path, content = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        assert (
            one(engine, IORequest(WRITE, fd, 0, memoryview(b"xyz"), 7)) == -errno.EBADF
        )
    finally:
        os.close(fd)
    assert path.read_bytes() == content


def test_many_requests_in_flight(engine, data_file):
    """256 reads of random ranges through run() at queue depth 16."""
    path, content = data_file
    rng = np.random.default_rng(1)
    fd = os.open(path, os.O_RDONLY)
    try:
        requests = []
        for tag in range(256):
            nbytes = int(rng.integers(1, 16384))
            offset = int(rng.integers(0, len(content) - nbytes))
            requests.append(read(fd, offset, nbytes, tag))
        done = engine.run(requests)
    finally:
        os.close(fd)
    assert sorted(c.tag for c in done) == list(range(256))
    for completion in done:
        request = requests[completion.tag]
        assert completion.result == len(request.buffer)
        assert (
            bytes(request.buffer)
            == content[request.offset : request.offset + len(request.buffer)]
        )


def give_up_after_one(completions) -> None:
    for _ in completions:
        raise RuntimeError("consumer gave up")


def test_a_stream_stopped_early_leaves_nothing_in_flight(engine, data_file):
    """A consumer that raises after the first completion: the requests still
    in flight finish before the exception leaves the loop, the rest are never
    submitted, and the next run gets only its own completions."""
    path, content = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        first = [read(fd, tag * 4096, 4096, tag) for tag in range(64)]
        with pytest.raises(RuntimeError, match="consumer gave up"):
            give_up_after_one(engine.stream(first))
        assert engine.in_flight == 0
        done = [r for r in first if bytes(r.buffer) != bytes(4096)]
        assert QUEUE_DEPTH <= len(done) < len(first)  # the rest never went out
        for request in done:
            offset = request.offset
            assert bytes(request.buffer) == content[offset : offset + 4096]
        second = [read(fd, 0, 100, 1000 + tag) for tag in range(3)]
        assert sorted(c.tag for c in engine.run(second)) == [1000, 1001, 1002]
    finally:
        os.close(fd)


def test_submit_beyond_queue_depth(engine, data_file):
    """io_uring refuses the batch (nothing is submitted); threads queue it."""
    path, _ = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        engine.submit([read(fd, 0, 10, tag) for tag in range(QUEUE_DEPTH - 2)])
        batch = [read(fd, 0, 10, tag) for tag in range(100, 105)]
        if engine.kind == "uring":
            with pytest.raises(ValueError, match="in flight"):
                engine.submit(batch)
            assert engine.in_flight == QUEUE_DEPTH - 2
        else:
            engine.submit(batch)
            assert engine.in_flight == QUEUE_DEPTH + 3
        done = []
        while engine.in_flight:
            done += engine.reap(1)
    finally:
        os.close(fd)
    assert all(c.result == 10 for c in done)
    assert len(done) == (QUEUE_DEPTH - 2 if engine.kind == "uring" else QUEUE_DEPTH + 3)


def test_reap_returns_at_least_min_complete(engine, data_file):
    path, _ = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        assert engine.reap(0) == []
        assert engine.reap(5) == []  # nothing in flight: returns at once
        engine.submit([read(fd, 4096 * i, 4096, i) for i in range(8)])
        got = engine.reap(8)
        assert sorted(c.tag for c in got) == list(range(8))
        assert engine.in_flight == 0
    finally:
        os.close(fd)


def test_close_with_requests_in_flight_waits_for_them(engine, tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    blocks = [random_bytes(65536, seed=i) for i in range(QUEUE_DEPTH)]
    writes = [
        IORequest(WRITE, fd, i * 65536, memoryview(b), i) for i, b in enumerate(blocks)
    ]
    engine.submit(writes)
    engine.close()
    engine.close()  # idempotent
    os.close(fd)
    assert path.read_bytes() == b"".join(blocks)


def test_use_after_close_raises(engine):
    engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.submit([read(0, 0, 1)])
    with pytest.raises(ValueError, match="closed"):
        engine.run([read(0, 0, 1)])
    if engine.kind == "uring":  # the thread engine still hands out what was done
        with pytest.raises(ValueError, match="closed"):
            engine.reap(1)
        with pytest.raises(ValueError, match="closed"):
            engine.fileno()
        assert engine.in_flight == 0


# ---------------------------------------------------------------- make_engine


def test_make_engine_kinds():
    auto = make_engine("auto")
    try:
        assert auto.kind == ("uring" if URING_PROBLEM is None else "threads")
    finally:
        auto.close()
    threads = make_engine("threads", 4)
    assert (threads.kind, threads.queue_depth) == ("threads", 4)
    threads.close()
    with pytest.raises(
        ConfigError, match="found 'bogus', expected auto, uring, threads"
    ):
        make_engine("bogus")


def _refusing_impl() -> types.SimpleNamespace:
    def refuse(entries: int, punt_reads: bool = False) -> None:
        raise OSError(errno.EPERM, "io_uring_setup: Operation not permitted")

    return types.SimpleNamespace(Uring=refuse)


@pytest.mark.parametrize(
    ("impl", "reason"),
    [(None, "NPUKV_NATIVE=0"), (_refusing_impl(), "io_uring_setup")],
    ids=["native-off", "setup-refused"],
)
def test_without_uring_auto_falls_back_and_uring_is_refused(
    monkeypatch, caplog, impl, reason
):
    monkeypatch.setattr(native, "IMPL", impl)
    with caplog.at_level(logging.INFO, logger="npukv_store.io.engine"):
        eng = make_engine("auto", 8)
    eng.close()
    assert (eng.kind, eng.queue_depth) == ("threads", 8)
    lines = [r for r in caplog.records if r.name == "npukv_store.io.engine"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert "io_uring unavailable" in lines[0].getMessage()
    assert reason in lines[0].getMessage()
    with pytest.raises(ConfigError, match=f"found 'uring'.*{reason}.*expected"):
        make_engine("uring")


# ---------------------------------------------------------------- the ring itself


@needs_uring
def test_buffers_stay_pinned_until_reaped(data_file):
    """The ring holds each buffer until its completion is reaped (a bytearray
    with an export cannot be resized), and drops each tag's reference."""
    path, content = data_file
    fd = os.open(path, os.O_RDONLY)
    ring = UringEngine(4)
    try:
        buf = bytearray(100)
        raw: Any = ring._ring  # takes a bytearray itself: no memoryview pin
        tag = 10**30  # a fresh int object, so its refcount is ours alone
        refs = sys.getrefcount(tag)
        raw.submit([(READ, fd, 0, buf, tag)])
        with pytest.raises(BufferError):
            buf.extend(b"x")
        assert [(c.tag, c.result) for c in ring.reap(1)] == [(tag, 100)]
        buf.extend(b"x")  # released
        assert bytes(buf[:100]) == content[:100]
        assert sys.getrefcount(tag) == refs
        raw.submit([(READ, fd, 0, buf, tag)])
        del ring, raw  # dealloc waits for the read, then unpins
        buf.extend(b"x")
        assert sys.getrefcount(tag) == refs
    finally:
        os.close(fd)


@needs_uring
def test_bad_requests_are_refused_whole(data_file):
    path, _ = data_file
    fd = os.open(path, os.O_RDONLY)
    ring = UringEngine(4)
    raw: Any = ring._ring
    try:
        good = (READ, fd, 0, bytearray(4), 1)
        for bad, exc in [
            ((READ, fd, 0, b"read-only", 2), BufferError),
            ((READ, fd, -1, bytearray(4), 2), ValueError),
            ((7, fd, 0, bytearray(4), 2), ValueError),
            ([READ, fd, 0, bytearray(4), 2], TypeError),
            ((READ, fd, 0), TypeError),
            ((READ, fd, 0, (), 2), ValueError),  # an empty vector
            ((READ, fd, 0, (bytearray(4), b"read-only"), 2), BufferError),
            ((READ, fd, 0, (bytearray(4), 5), 2), TypeError),
            ((READ, fd, 0, tuple(bytearray(1) for _ in range(2000)), 2), ValueError),
        ]:
            with pytest.raises(exc):
                raw.submit([good, bad])
            assert ring.in_flight == 0
        with pytest.raises(ValueError, match="1..4096"):
            UringEngine(0)
    finally:
        ring.close()
        os.close(fd)


@needs_uring
def test_a_second_thread_gets_runtime_error_while_one_waits():
    """reap() waits without the GIL; another thread's call must not race it."""
    ring = UringEngine(4)
    rfd, wfd = os.pipe()
    buf = bytearray(3)
    ring.submit([IORequest(READ, rfd, 0, memoryview(buf), 1)])  # waits for data
    got = []
    waiter = threading.Thread(target=lambda: got.extend(ring.reap(1)))
    waiter.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            ring.fileno()
        except RuntimeError:
            break
        time.sleep(0.001)
    else:
        pytest.fail("reap never held the ring")
    with pytest.raises(RuntimeError, match="in use by another thread"):
        ring.submit([])
    os.write(wfd, b"abc")
    waiter.join(10)
    ring.close()
    os.close(rfd)
    os.close(wfd)
    assert [(c.tag, c.result) for c in got] == [(1, 3)]
    assert bytes(buf) == b"abc"


@needs_uring
def test_a_signal_interrupts_reap_and_nothing_is_lost():
    """A signal handler's exception escapes a waiting reap(); the completion
    stays in the ring for the next one."""

    class Alarm(Exception):
        pass

    def on_alarm(signum, frame):
        raise Alarm

    ring = UringEngine(2)
    rfd, wfd = os.pipe()
    buf = bytearray(2)
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        ring.submit([IORequest(READ, rfd, 0, memoryview(buf), 5)])
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Alarm):
            ring.reap(1)
        assert ring.in_flight == 1
        os.write(wfd, b"hi")
        assert [(c.tag, c.result) for c in ring.reap(1)] == [(5, 2)]
        assert bytes(buf) == b"hi"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        ring.close()
        os.close(rfd)
        os.close(wfd)


FORK_SCRIPT = """
import os, sys
from npukv_store.io.engine import READ, IORequest
from npukv_store.io.uring import UringEngine
fd = os.open(sys.argv[1], os.O_RDONLY)
ring = UringEngine(4)
ring.submit([IORequest(READ, fd, 0, memoryview(bytearray(10)), 1)])
pid = os.fork()
if pid == 0:
    try:
        ring.reap(1)
        os._exit(3)
    except RuntimeError as exc:
        assert "forked child" in str(exc), exc
    del ring  # unmaps and closes without touching the parent's rings
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert [(c.tag, c.result) for c in ring.reap(1)] == [(1, 10)]
ring.close()
print("ok")
"""


@needs_uring
def test_fork_child_must_not_use_the_parents_ring(data_file):
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, str(data_file[0])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------- O_DIRECT


@pytest.fixture
def direct_dir():
    if not os.path.isdir("/var/tmp"):
        pytest.skip("no /var/tmp")
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="npukv-direct-") as path:
        fd, is_direct = direct.open_direct(
            os.path.join(path, "probe"), os.O_RDWR | os.O_CREAT
        )
        os.close(fd)
        if not is_direct:
            pytest.skip("/var/tmp refuses O_DIRECT here")
        yield path


def test_direct_io_aligned_round_trip_and_unaligned_read(engine, direct_dir):
    block = direct.DIRECT_ALIGN_BYTES
    fd, is_direct = direct.open_direct(
        os.path.join(direct_dir, "f"), os.O_RDWR | os.O_CREAT
    )
    try:
        assert is_direct
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        content = random_bytes(8 * block)
        src = direct.aligned_buffer(len(content))
        assert src.ctypes.data % block == 0
        src[:] = np.frombuffer(content, np.uint8)
        writes = [
            IORequest(
                WRITE,
                fd,
                i * 2 * block,
                src[i * 2 * block : (i + 1) * 2 * block].data,
                i,
            )
            for i in range(4)
        ]
        assert sorted(c.result for c in engine.run(writes)) == [2 * block] * 4
        dest = direct.aligned_buffer(len(content))
        assert one(engine, IORequest(READ, fd, 0, dest.data, 9)) == len(content)
        assert dest.tobytes() == content
        # O_DIRECT refuses an unaligned offset; the engines do not fix it up
        assert (
            one(engine, IORequest(READ, fd, 100, dest[:block].data, 1)) == -errno.EINVAL
        )
        for offset, nbytes in [
            (100, 5000),
            (block, block),
            (7 * block + 5, block),
            (len(content) + 1, 10),
        ]:
            out = bytearray(nbytes)
            got = direct.read_unaligned(engine, fd, offset, memoryview(out))
            want = content[offset : offset + nbytes]
            assert got == len(want)
            assert bytes(out[:got]) == want
        assert (
            direct.read_unaligned(engine, -1, 0, memoryview(bytearray(1)))
            == -errno.EBADF
        )
        with pytest.raises(ValueError, match="offset >= 0"):
            direct.read_unaligned(engine, fd, -1, memoryview(bytearray(1)))
    finally:
        os.close(fd)


def test_open_direct_falls_back_to_buffered_with_one_warning(
    monkeypatch, caplog, tmp_path
):
    real_fcntl = fcntl.fcntl

    def refuse_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refuse_direct)
    monkeypatch.setattr(direct, "_warned_devices", set())
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    with caplog.at_level(logging.WARNING, logger="npukv_store.io.direct"):
        for name in ("a", "b"):  # O_EXCL still holds: the file is created once
            fd, is_direct = direct.open_direct(tmp_path / name, flags)
            assert not is_direct
            assert not real_fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
            os.close(fd)
    assert len(caplog.records) == 1
    assert "refuses O_DIRECT" in caplog.records[0].getMessage()
    with pytest.raises(FileExistsError):
        direct.open_direct(tmp_path / "a", flags)


def test_open_direct_on_procfs_is_buffered():
    fd, is_direct = direct.open_direct("/proc/self/status", os.O_RDONLY)
    os.close(fd)
    assert not is_direct


def test_thread_engine_completes_a_request_with_a_bad_buffer(tmp_path):
    """Regression: a non-OSError in a worker (a read into a read-only buffer)
    was swallowed and its completion never came, so reap() hung."""
    from npukv_store.io.engine import READ, IORequest, make_engine

    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    engine = make_engine("threads", 2)
    try:
        readonly = memoryview(b"\0" * 4096)
        done = engine.run([IORequest(READ, fd, 0, readonly, 7)])
        assert [(c.tag, c.result) for c in done] == [(7, -errno.EINVAL)]
    finally:
        engine.close()
        os.close(fd)


def test_uring_punts_reads_only_with_several_in_flight(tmp_path):
    """IOSQE_ASYNC for reads when queue_depth > 1 (cached pages then copy on
    io-wq workers, not inline on our thread); results are the same either way."""
    try:
        engines = [UringEngine(1), UringEngine(8)]
    except (ImportError, OSError) as exc:
        pytest.skip(f"io_uring cannot start here: {exc}")
    path = tmp_path / "f"
    data = np.random.default_rng(3).integers(0, 255, 1 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for engine in engines:
            out = np.zeros(1 << 20, np.uint8)
            view = out.data.cast("B")
            requests = [
                IORequest(READ, fd, off, view[off : off + 65536], off)
                for off in range(0, 1 << 20, 65536)
            ]
            assert all(c.result == 65536 for c in engine.run(requests))
            np.testing.assert_array_equal(out, data)
    finally:
        for engine in engines:
            engine.close()
        os.close(fd)


def test_registered_buffer_round_trip_through_fixed_requests(engine, direct_dir):
    """Requests wholly inside the registered buffer go as READ/WRITE_FIXED (the
    uring engine counts them); others as before; bytes are the same either
    way, buffered or O_DIRECT. The thread engine declines registration."""
    block = direct.DIRECT_ALIGN_BYTES
    pinned = direct.aligned_buffer(16 * block)
    pinned[:] = np.frombuffer(random_bytes(16 * block, seed=5), np.uint8)
    registered = engine.register_buffer(pinned.data)
    assert registered == (engine.kind == "uring")
    outside = direct.aligned_buffer(4 * block)
    outside[:] = 7
    for flags, name in ((0, "buffered"), (os.O_DIRECT, "direct")):
        fd = os.open(os.path.join(direct_dir, name), os.O_RDWR | os.O_CREAT | flags)
        try:
            writes = [
                IORequest(WRITE, fd, 0, pinned[: 8 * block].data, 0),
                IORequest(WRITE, fd, 8 * block, pinned[8 * block :].data, 1),
                IORequest(WRITE, fd, 16 * block, outside.data, 2),
            ]
            assert sorted(c.result for c in engine.run(writes)) == [
                4 * block, 8 * block, 8 * block,
            ]  # fmt: skip
            back = direct.aligned_buffer(20 * block)
            assert one(engine, IORequest(READ, fd, 0, back.data, 3)) == 20 * block
            assert back[: 16 * block].tobytes() == pinned.tobytes()
            assert (back[16 * block :] == 7).all()
            expected = pinned[2 * block : 4 * block].copy()
            pinned[:] = 0
            assert (
                one(engine, IORequest(READ, fd, 2 * block, pinned[: 2 * block].data, 4))
                == 2 * block
            )
            assert pinned[: 2 * block].tobytes() == expected.tobytes()
        finally:
            os.close(fd)
    if registered:
        # two writes and one read per pass fell inside the buffer, twice
        assert engine.fixed_submitted == 6
        with pytest.raises(ValueError, match="already registered"):
            engine._ring.register_buffer(pinned.data)
