"""npukv_store.device: the CPU backend for real (native copy_ptrs and its twin),
the NPU backend against a recording fake ``torch.npu`` (threads, the docs/device.md
§1.3 ordering, chunked registration and its fallbacks, vllm-ascend's batch op),
and the CUDA backend where a GPU is visible."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from npukv_store import _twin, native
from npukv_store.device import REGISTER_CHUNK_BYTES, get_backend, ordering
from npukv_store.device.cpu import CpuBackend
from npukv_store.device.host import chunk_ranges
from npukv_store.device.npu import ACL_HOST_REG_PINNED, NpuBackend
from npukv_store.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
needs_native = pytest.mark.skipif(
    not native.IS_NATIVE, reason="the C extension is not in use"
)


@pytest.fixture(params=["native", "twin"])
def impl(request, monkeypatch):
    if request.param == "twin":  # native.py binds once: swap the bound function
        monkeypatch.setattr(native, "_copy_ptrs", _twin.copy_ptrs)
    return request.param


def addr(array: np.ndarray, offset: int = 0) -> int:
    return array.ctypes.data + offset


def ptrs(values) -> np.ndarray:
    return np.asarray(list(values), dtype=np.int64)


def random_runs(rng, num_runs: int, max_bytes: int) -> list[int]:
    return [int(n) for n in rng.integers(0, max_bytes, num_runs)]


# ---------------------------------------------------------------------------
# copy_ptrs and the CPU backend
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [4096, 256 * 1024])  # small; threaded path
def test_cpu_copy_runs_round_trip(impl, max_bytes):
    """Gather random runs of a "device" buffer into a ring (d2h), scatter them
    back into other places (h2d): the bytes arrive where the runs say."""
    rng = np.random.default_rng(max_bytes)
    sizes = random_runs(rng, 64, max_bytes)
    device = rng.integers(0, 256, 2 * sum(sizes) + 1, dtype=np.uint8)
    ring = np.zeros(sum(sizes) + 1, dtype=np.uint8)
    src_offsets = np.cumsum([0, *sizes[:-1]]) * 2  # every other stretch
    ring_offsets = np.cumsum([0, *sizes[:-1]])
    backend = get_backend("cpu")
    xfer = backend.new_stream()
    backend.copy_runs(
        ptrs(addr(device, int(o)) for o in src_offsets),
        ptrs(addr(ring, int(o)) for o in ring_offsets),
        ptrs(sizes),
        "d2h",
        xfer,
    )
    expected = np.concatenate(
        [device[o : o + n] for o, n in zip(src_offsets, sizes, strict=True)]
    )
    assert np.array_equal(ring[: sum(sizes)], expected)
    # h2d into the gaps between the source stretches
    back = np.zeros_like(device)
    dst_offsets = src_offsets + np.asarray(sizes)
    backend.copy_runs(
        ptrs(addr(ring, int(o)) for o in ring_offsets),
        ptrs(addr(back, int(o)) for o in dst_offsets),
        ptrs(sizes),
        "h2d",
        xfer,
    )
    for s, d, n in zip(src_offsets, dst_offsets, sizes, strict=True):
        assert np.array_equal(back[d : d + n], device[s : s + n])
    done = backend.new_event()
    done.record(xfer)
    assert done.query()


def test_copy_ptrs_returns_bytes_and_allows_empty_runs(impl):
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    n = native.copy_ptrs(
        ptrs([addr(src), 0, addr(src, 50)]),
        ptrs([addr(dst, 10), 0, addr(dst, 60)]),
        ptrs([20, 0, 5]),
    )
    assert n == 25
    assert np.array_equal(dst[10:30], src[:20])
    assert np.array_equal(dst[60:65], src[50:55])
    assert not dst[:10].any()
    assert not dst[30:60].any()


def test_copy_ptrs_checks_every_run_first(impl):
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    good = (ptrs([addr(src)]), ptrs([addr(dst)]))
    with pytest.raises(ValueError, match=r"run 1 has size -1, expected >= 0"):
        native.copy_ptrs(
            ptrs([addr(src), addr(src)]), ptrs([addr(dst), addr(dst)]), ptrs([8, -1])
        )
    assert not dst.any()  # run 0 was not copied either
    with pytest.raises(ValueError, match="expected non-zero addresses"):
        native.copy_ptrs(ptrs([0]), good[1], ptrs([4]))
    with pytest.raises(ValueError, match="sizes has 2 entries and src_ptrs 1"):
        native.copy_ptrs(*good, ptrs([4, 4]))
    with pytest.raises(ValueError, match="expected a 1-D C-contiguous native int64"):
        native.copy_ptrs(*good, np.asarray([4.0]))
    with pytest.raises(ValueError, match="expected a 1-D C-contiguous native int64"):
        native.copy_ptrs(good[0].reshape(1, 1), good[1], ptrs([4]))
    with pytest.raises(ValueError, match="threads is 65"):
        native.copy_ptrs(*good, ptrs([4]), threads=65)
    with pytest.raises(ValueError, match="direction is 'sideways'"):
        CpuBackend().copy_runs(*good, ptrs([4]), "sideways", CpuBackend().new_stream())


def test_cpu_backend_primitives():
    backend = get_backend(torch.device("cpu"))
    assert backend.kind == "cpu"
    assert backend.device == torch.device("cpu")
    backend.bind_thread()
    stream = backend.current_stream()
    assert stream.raw_handle() == 0
    ev = backend.new_event(timing=True)
    ev.record(stream)
    ev.record()
    stream.wait_event(ev)
    stream.wait_stream(backend.new_stream())
    assert ev.query()
    ev.synchronize()
    backend.synchronize()
    with backend.stream_ctx(stream):
        pass
    ring = np.zeros(8192, dtype=np.uint8)
    region = backend.register_host(addr(ring), ring.nbytes)
    assert (region.ptr, region.nbytes, region.registered) == (addr(ring), 8192, False)
    region.close()
    region.close()
    assert not backend.is_host_registered(torch.zeros(4))
    pinned = backend.alloc_pinned(64)
    assert pinned.dtype == torch.uint8
    assert pinned.numel() == 64


def test_ordering_helpers_on_cpu():
    backend = get_backend("cpu")
    src = np.arange(64, dtype=np.uint8)
    ring = np.zeros(64, dtype=np.uint8)
    xfer = backend.new_stream()
    written = ordering.record_written(backend)
    done = ordering.d2h_after(
        backend, written, xfer, ptrs([addr(src)]), ptrs([addr(ring)]), ptrs([64])
    )
    assert done.query()
    assert np.array_equal(ring, src)
    back = np.zeros(64, dtype=np.uint8)
    compute = backend.current_stream()
    done = ordering.h2d_after(
        backend, compute, xfer, ptrs([addr(ring)]), ptrs([addr(back)]), ptrs([64])
    )
    compute.wait_event(done)
    assert np.array_equal(back, src)


def test_get_backend_rejects_other_devices(monkeypatch):
    with pytest.raises(ConfigError, match=r"found type 'meta'.*expected one of cpu"):
        get_backend(torch.device("meta"))
    with pytest.raises(ConfigError, match="found type 'tpu'"):
        get_backend("tpu:0")
    with pytest.raises(ConfigError, match="expected 'cpu', 'cuda"):
        get_backend("npu:x")
    monkeypatch.delattr(torch, "npu", raising=False)
    with pytest.raises(ConfigError, match="torch_npu to be imported"):
        get_backend("npu:0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="is_available"):
            get_backend("cuda")


def test_backends_are_imported_lazily():
    """docs/architecture.md (import direction): importing the device layer and
    using the CPU backend loads neither the CUDA nor the NPU module."""
    code = (
        "import sys; from npukv_store.device import get_backend; get_backend('cpu');"
        "print(sorted(m for m in sys.modules if m.startswith('npukv_store.device.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    loaded = out.stdout.strip()
    assert "device.npu" not in loaded
    assert "device.cuda" not in loaded
    assert "device.cpu" in loaded


def test_chunk_ranges():
    assert chunk_ranges(4096, 10, chunk_bytes=4) == [(4096, 4), (4100, 4), (4104, 2)]
    assert chunk_ranges(4096, 8, chunk_bytes=4) == [(4096, 4), (4100, 4)]
    with pytest.raises(ValueError, match="expected all > 0"):
        chunk_ranges(0, 10)


# ---------------------------------------------------------------------------
# The native runtime calls without their runtime
# ---------------------------------------------------------------------------


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


@needs_native
@pytest.mark.skipif(_loadable("libascendcl.so"), reason="an Ascend runtime is here")
def test_acl_calls_name_the_missing_library():
    empty = ptrs([])
    with pytest.raises(OSError, match="libascendcl.so") as info:
        native.acl_memcpy_batch(empty, empty, empty, 1, 0)
    assert info.value.errno == errno.ENOENT
    with pytest.raises(OSError, match="libascendcl.so"):
        native.acl_host_register(4096, 4096, ACL_HOST_REG_PINNED)
    with pytest.raises(OSError, match="libascendcl.so"):
        native.acl_host_unregister(4096)


@needs_native
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_memcpy_without_a_device_raises():
    """No libcudart: OSError naming it; a libcudart without a driver or GPU:
    RuntimeError naming the call and the CUDA error. Never a crash."""
    src = np.zeros(8, dtype=np.uint8)
    with pytest.raises((OSError, RuntimeError), match="libcudart|cudaMemcpyAsync"):
        native.cuda_memcpy_batch(ptrs([addr(src)]), ptrs([addr(src)]), ptrs([8]), 1, 0)


def test_runtime_calls_without_the_extension_raise_enosys(monkeypatch):
    monkeypatch.setattr(native, "IMPL", None)
    empty = ptrs([])
    for call in (
        lambda: native.acl_memcpy_batch(empty, empty, empty, 1, 0),
        lambda: native.cuda_memcpy_batch(empty, empty, empty, 1, 0),
        lambda: native.acl_host_register(4096, 4096, 0),
        lambda: native.acl_host_unregister(4096),
        native.cuda_get_last_error,
        native.cuda_copy_api,
    ):
        with pytest.raises(OSError, match="needs the C extension") as info:
            call()
        assert info.value.errno == errno.ENOSYS


# ---------------------------------------------------------------------------
# The NPU backend against a recording fake torch.npu
# ---------------------------------------------------------------------------


class FakeNpu:
    """Records, in order, what the backend asks of torch.npu: (op, *details)."""

    def __init__(self, npurt=None, device_name="Ascend910B3"):
        self.log: list[tuple] = []
        self._names = itertools.count()
        self._local = threading.local()
        self.compute = self.Stream()
        self._device_name = device_name
        if npurt is not None:
            self.npurt = lambda: npurt

    # device
    def set_device(self, index):
        self.log.append(("set_device", index, threading.get_ident()))

    def current_device(self):
        return 0

    def get_device_name(self, index):
        return self._device_name

    def synchronize(self, device=None):
        self.log.append(("synchronize",))

    # streams and events
    def Stream(self, device=None, priority=0):  # noqa: N802 (torch's name)
        return FakeStream(self, f"s{next(self._names)}")

    def Event(self, enable_timing=False):  # noqa: N802
        return FakeEvent(self, f"e{next(self._names)}")

    def current_stream(self, device=None):
        return getattr(self._local, "stream", self.compute)

    @contextlib.contextmanager
    def stream(self, s):
        before = self.current_stream()
        self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = before

    def ops(self, op: str) -> list[tuple]:
        return [entry for entry in self.log if entry[0] == op]

    def index(self, entry: tuple) -> int:
        return self.log.index(entry)


class FakeStream:
    def __init__(self, npu: FakeNpu, name: str):
        self.npu, self.name = npu, name
        self.handle = 0x1000 + int(name[1:])  # a distinct raw aclrtStream

    @property
    def npu_stream(self):
        self.npu.log.append(("npu_stream", self.name))
        return self.handle

    def wait_event(self, ev):
        self.npu.log.append(("wait_event", self.name, ev.name))

    def wait_stream(self, other):
        self.npu.log.append(("wait_stream", self.name, other.name))


class FakeEvent:
    def __init__(self, npu: FakeNpu, name: str):
        self.npu, self.name = npu, name

    def record(self, stream=None):
        stream = stream if stream is not None else self.npu.current_stream()
        self.npu.log.append(("record", self.name, stream.name))

    def query(self):
        return True

    def synchronize(self):
        pass


class FakeNpurt:
    """npuHostRegister returns codes[i] for its i-th call (0 past the end)."""

    def __init__(self, codes=()):
        self.codes = list(codes)
        self.calls: list[tuple] = []

    def npuHostRegister(self, ptr, size, flags):  # noqa: N802 (torch_npu's name)
        self.calls.append(("register", ptr, size, flags))
        return self.codes.pop(0) if self.codes else 0

    def npuHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def fake_npu(monkeypatch):
    """Install a FakeNpu (with npurt) as torch.npu; returns a factory to
    replace it with another one."""

    def install(**kwargs) -> FakeNpu:
        fake = FakeNpu(**kwargs)
        monkeypatch.setattr(torch, "npu", fake, raising=False)
        return fake

    install(npurt=FakeNpurt())
    return install


@pytest.fixture
def acl_calls(monkeypatch):
    """Replace the C extension's ACL calls by recorders; returns their log."""
    calls: list[tuple] = []

    def memcpy(src, dst, sizes, kind, stream):
        calls.append(
            ("memcpy", src.tolist(), dst.tolist(), sizes.tolist(), kind, stream)
        )
        if torch.npu.log is not None:
            torch.npu.log.append(("acl_memcpy", kind, stream))
        return int(sizes.sum())

    monkeypatch.setattr(native, "acl_memcpy_batch", memcpy)
    monkeypatch.setattr(
        native,
        "acl_host_register",
        lambda p, n, f: calls.append(("register", p, n, f)) or 0,
    )
    monkeypatch.setattr(
        native, "acl_host_unregister", lambda p: calls.append(("unregister", p)) or 0
    )
    return calls


RUNS = (ptrs([0x10000, 0x20000]), ptrs([0x30000, 0x40000]), ptrs([4096, 8192]))


def test_bind_thread_sets_the_device_in_every_thread(fake_npu):
    fake = fake_npu(npurt=FakeNpurt())
    backend = get_backend("npu:3")
    assert isinstance(backend, NpuBackend)
    assert backend.kind == "npu"
    barrier = threading.Barrier(3)
    idents = []

    def worker():
        barrier.wait()
        backend.bind_thread()
        idents.append(threading.get_ident())

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    calls = fake.ops("set_device")
    assert sorted(t for _, _, t in calls) == sorted(idents)
    assert {index for _, index, _ in calls} == {3}


def test_save_waits_on_the_written_event_before_copying(fake_npu, acl_calls):
    """docs/device.md §1.3 save: the transfer stream waits on the event recorded
    after the KV write, then the raw handle is read (draining torch_npu's task
    queue, so the wait is launched), then the ACL copies, then `done`."""
    fake = fake_npu(npurt=FakeNpurt())
    backend = get_backend("npu:0")
    xfer = backend.new_stream()
    written = ordering.record_written(backend)  # forward thread
    result = {}

    def transfer():
        backend.bind_thread()
        result["done"] = ordering.d2h_after(backend, written, xfer, *RUNS)

    thread = threading.Thread(target=transfer)
    thread.start()
    thread.join()
    w, x, c = written.torch.name, xfer.torch.name, fake.compute.name
    steps = [
        ("record", w, c),
        ("set_device", 0, thread.ident),
        ("wait_event", x, w),
        ("npu_stream", x),
        ("acl_memcpy", 2, xfer.torch.handle),
        ("record", result["done"].torch.name, x),
    ]
    assert [fake.index(step) for step in steps] == sorted(
        fake.index(step) for step in steps
    )
    assert acl_calls == [("memcpy", *(r.tolist() for r in RUNS), 2, xfer.torch.handle)]


def test_load_waits_on_the_compute_stream_before_copying(fake_npu, acl_calls):
    fake = fake_npu(npurt=FakeNpurt())
    backend = get_backend("npu")
    xfer, compute = backend.new_stream(), backend.current_stream()
    done = ordering.h2d_after(backend, compute, xfer, *RUNS)
    compute.wait_event(done)
    x, c, d = xfer.torch.name, fake.compute.name, done.torch.name
    steps = [
        ("wait_stream", x, c),
        ("npu_stream", x),
        ("acl_memcpy", 1, xfer.torch.handle),
        ("record", d, x),
        ("wait_event", c, d),
    ]
    assert [fake.index(step) for step in steps] == list(
        range(fake.index(steps[0]), fake.index(steps[0]) + len(steps))
    )


def test_vllm_ascend_batch_op_is_used_on_the_stream(fake_npu, acl_calls, monkeypatch):
    fake = fake_npu(npurt=FakeNpurt())
    calls = []

    def swap_blocks_batch(src, dst, sizes, direction):
        assert src.dtype == dst.dtype == sizes.dtype == torch.int64
        current = torch.npu.current_stream().name
        calls.append((src.tolist(), dst.tolist(), sizes.tolist(), direction, current))
        fake.log.append(("swap", direction))

    ops_ns = SimpleNamespace(swap_blocks_batch=swap_blocks_batch)
    monkeypatch.setattr(torch.ops, "_C_ascend", ops_ns, raising=False)
    backend = get_backend("npu:0")
    xfer = backend.new_stream()
    written = ordering.record_written(backend)
    ordering.d2h_after(backend, written, xfer, *RUNS)
    ordering.h2d_after(backend, backend.current_stream(), xfer, *RUNS)
    lists = [r.tolist() for r in RUNS]
    assert calls == [(*lists, 1, xfer.torch.name), (*lists, 0, xfer.torch.name)]
    assert fake.index(("wait_event", xfer.torch.name, written.torch.name)) < (
        fake.index(("swap", 1))
    )
    assert acl_calls == []  # no raw ACL copy when the op is there


def test_registration_is_chunked_and_undone_on_close(fake_npu):
    npurt = FakeNpurt()
    fake = fake_npu(npurt=npurt)
    backend = get_backend("npu:1")
    base = 1 << 44
    region = backend.register_host(base, 150 * GiB)
    assert region.registered
    assert region.ptr == base
    assert region.nbytes == 150 * GiB
    chunk = REGISTER_CHUNK_BYTES
    assert chunk == 64 * GiB
    assert npurt.calls == [
        ("register", base, chunk, ACL_HOST_REG_PINNED),
        ("register", base + chunk, chunk, ACL_HOST_REG_PINNED),
        ("register", base + 2 * chunk, 22 * GiB, ACL_HOST_REG_PINNED),
    ]
    assert fake.ops("set_device")  # registration runs on a bound thread
    region.close()
    assert npurt.calls[3:] == [
        ("unregister", base),
        ("unregister", base + chunk),
        ("unregister", base + 2 * chunk),
    ]
    region.close()
    assert len(npurt.calls) == 6
    assert not region.registered


def test_registration_without_npurt_uses_the_extension(fake_npu, acl_calls):
    fake_npu(npurt=None)
    backend = get_backend("npu:0")
    region = backend.register_host(1 << 40, 100 * GiB)
    assert region.registered
    assert acl_calls == [
        ("register", 1 << 40, 64 * GiB, ACL_HOST_REG_PINNED),
        ("register", (1 << 40) + 64 * GiB, 36 * GiB, ACL_HOST_REG_PINNED),
    ]
    region.close()
    assert acl_calls[2:] == [
        ("unregister", 1 << 40),
        ("unregister", (1 << 40) + 64 * GiB),
    ]


@pytest.mark.skipif(_loadable("libascendcl.so"), reason="an Ascend runtime is here")
@pytest.mark.parametrize("extension", ["built", "not in use"])
def test_registration_failing_everywhere_warns_once(
    fake_npu, caplog, monkeypatch, extension
):
    """No npurt and no libascendcl.so (or no extension at all): the ring stays
    unregistered, one warning says why, nothing is raised."""
    if extension == "not in use":
        monkeypatch.setattr(native, "IMPL", None)
    elif not native.IS_NATIVE:
        pytest.skip("the C extension is not in use")
    fake_npu(npurt=None)
    backend = get_backend("npu:0")
    with caplog.at_level(logging.INFO, logger="npukv_store.device"):
        region = backend.register_host(1 << 40, 4 * GiB)
    assert not region.registered
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    expected = "libascendcl.so" if extension == "built" else "needs the C extension"
    assert expected in warnings[0].getMessage()
    region.close()


def test_npurt_error_code_falls_back_and_rolls_back(fake_npu, acl_calls):
    """npuHostRegister takes chunk 0, refuses chunk 1 (207001): chunk 0 is
    unregistered again, then the C extension registers the whole range."""
    npurt = FakeNpurt(codes=[0, 207001])
    fake_npu(npurt=npurt)
    backend = get_backend("npu:0")
    base = 1 << 40
    region = backend.register_host(base, 100 * GiB)
    assert npurt.calls == [
        ("register", base, 64 * GiB, ACL_HOST_REG_PINNED),
        ("register", base + 64 * GiB, 36 * GiB, ACL_HOST_REG_PINNED),
        ("unregister", base),
    ]
    assert region.registered
    assert "aclrtHostRegister" in region.via
    assert [c[0] for c in acl_calls] == ["register", "register"]


def test_npurt_error_code_and_no_extension_leave_it_unregistered(
    fake_npu, caplog, monkeypatch
):
    monkeypatch.setattr(native, "IMPL", None)
    fake_npu(npurt=FakeNpurt(codes=[207001]))
    backend = get_backend("npu:0")
    with caplog.at_level(logging.WARNING, logger="npukv_store.device"):
        region = backend.register_host(1 << 40, GiB)
    assert not region.registered
    (warning,) = caplog.records
    assert "error 207001" in warning.getMessage()


def test_npurt_that_raises_counts_as_a_refusal(fake_npu, acl_calls):
    fake = fake_npu(npurt=None)

    def npurt():
        raise RuntimeError("npurt is not supported by this driver")

    fake.npurt = npurt
    region = get_backend("npu:0").register_host(1 << 40, GiB)
    assert region.registered
    assert acl_calls == [("register", 1 << 40, GiB, ACL_HOST_REG_PINNED)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here")
def test_alloc_pinned_falls_back_to_pageable_memory(fake_npu, caplog):
    with caplog.at_level(logging.WARNING, logger="npukv_store.device"):
        buf = get_backend("npu:0").alloc_pinned(64)
    assert buf.dtype == torch.uint8
    assert buf.numel() == 64
    assert "pinned host memory is unavailable" in caplog.text


def test_registration_is_skipped_on_310p(fake_npu, acl_calls):
    npurt = FakeNpurt()
    fake_npu(npurt=npurt, device_name="Ascend310P3")
    region = get_backend("npu:0").register_host(1 << 40, GiB)
    assert not region.registered
    assert npurt.calls == []
    assert acl_calls == []


def test_is_host_registered_never_raises(fake_npu):
    class Probe:
        def __init__(self, result):
            self.result = result

        def is_pinned(self):
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

    backend = get_backend("npu:0")
    assert backend.is_host_registered(Probe(True))
    assert not backend.is_host_registered(Probe(False))
    assert not backend.is_host_registered(Probe(RuntimeError("207001")))


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_cuda_round_trip_through_a_registered_host_buffer():
    backend = get_backend("cuda")
    backend.bind_thread()
    page = 64 * 1024
    cache = torch.randint(0, 256, (16, page), dtype=torch.uint8, device=backend.device)
    host = np.zeros(8 * page, dtype=np.uint8)
    region = backend.register_host(addr(host), host.nbytes)
    try:
        blocks, slots = [3, 7, 11, 0], [0, 1, 2, 3]
        xfer = backend.new_stream()
        written = ordering.record_written(backend)
        done = ordering.d2h_after(
            backend,
            written,
            xfer,
            ptrs(cache[b].data_ptr() for b in blocks),
            ptrs(addr(host, s * page) for s in slots),
            ptrs([page] * 4),
        )
        done.synchronize()
        for b, s in zip(blocks, slots, strict=True):
            assert np.array_equal(
                host[s * page : (s + 1) * page], cache[b].cpu().numpy()
            )
        done = ordering.h2d_after(
            backend,
            backend.current_stream(),
            xfer,
            ptrs(addr(host, s * page) for s in slots),
            ptrs(cache[b].data_ptr() for b in [12, 13, 14, 15]),
            ptrs([page] * 4),
        )
        done.synchronize()
        assert torch.equal(cache[12:16], cache[blocks])
    finally:
        region.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
@pytest.mark.parametrize("batch_api", [True, False])
def test_cuda_many_runs_batch_and_loop_copy_the_same_bytes(batch_api):
    """2,048 scattered runs each way, as one cuMemcpyBatchAsync where the driver
    has it (the call used is reported) and as the cudaMemcpyAsync loop."""
    import ctypes

    backend = get_backend("cuda")
    backend.bind_thread()
    run, count = 4096, 2048
    cache = torch.randint(
        0, 256, (2 * count, run), dtype=torch.uint8, device=backend.device
    )
    host = np.zeros(count * run, dtype=np.uint8)
    region = backend.register_host(addr(host), host.nbytes)
    order = np.random.default_rng(7).permutation(count)
    stream = torch.cuda.Stream()
    try:
        native.cuda_memcpy_batch(
            ptrs(cache[int(b)].data_ptr() for b in order),
            ptrs(addr(host, i * run) for i in range(count)),
            ptrs([run] * count), 2, stream.cuda_stream, batch_api,
        )  # fmt: skip
        stream.synchronize()
        expected = cache[torch.as_tensor(order, device=backend.device)].cpu().numpy()
        assert np.array_equal(host.reshape(count, run), expected)
        native.cuda_memcpy_batch(
            ptrs(addr(host, i * run) for i in range(count)),
            ptrs(cache[count + i].data_ptr() for i in range(count)),
            ptrs([run] * count), 1, stream.cuda_stream, batch_api,
        )  # fmt: skip
        stream.synchronize()
        assert torch.equal(cache[count:], cache[torch.as_tensor(order).cuda()])
    finally:
        region.close()
    driver = ctypes.CDLL("libcuda.so.1")
    has_batch = any(
        hasattr(driver, name)
        for name in ("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync")
    )
    expected_api = (
        "cuMemcpyBatchAsync" if batch_api and has_batch else "cudaMemcpyAsync"
    )
    assert native.cuda_copy_api() == expected_api
