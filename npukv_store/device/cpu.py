"""The CPU backend: no streams to order, copies done at once by a native memcpy.

Runs in: any thread (bind_thread() is a no-op, kept for the protocol).

    CpuStream  - stands in for a stream: waits are no-ops, raw handle 0
    CpuEvent   - always complete (every copy has finished when copy_runs returns)
    CpuBackend - copy_runs = npukv_store.native.copy_ptrs (GIL released from
                 _GIL_MINSIZE bytes); register_host reports registered=False

torch's own CPU stream/event stubs are not used: ``torch.Event("cpu").record()``
raises ("cpu backend doesn't support events", docs/device.md §5), and
``pin_memory=True`` raises without an accelerator, so alloc_pinned returns a
plain tensor.
"""

from __future__ import annotations

import ctypes
import time
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from npukv_store import native
from npukv_store.device.base import Direction, Event, Kind, Stream, as_runs
from npukv_store.device.host import HostRange


class CpuStream:
    """A stream with nothing to order: CPU copies are synchronous."""

    def wait_event(self, ev: Event) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass

    def raw_handle(self) -> int:
        return 0


class CpuEvent:
    """An event that is always complete; it keeps the time it was recorded."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def record(self, stream: Stream | None = None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self, end: CpuEvent) -> float:
        return (end.at - self.at) * 1e3


class CpuBackend:
    """DeviceBackend for the CPU."""

    kind: Kind = "cpu"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._stream = CpuStream()

    def bind_thread(self) -> None:
        pass

    def current_stream(self) -> Stream:
        return self._stream

    def new_stream(self) -> Stream:
        return CpuStream()

    def stream_ctx(self, s: Stream) -> AbstractContextManager[None]:
        return nullcontext()

    def new_event(self, timing: bool = False) -> Event:
        return CpuEvent()

    def synchronize(self) -> None:
        pass

    def register_host(self, ptr: int, nbytes: int) -> HostRange:
        return HostRange(ptr, nbytes)  # nothing to register with: registered=False

    def is_host_registered(self, t: torch.Tensor) -> bool:
        return False

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_view(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes at ``ptr`` as a writable numpy array: on the CPU "device"
        memory is host memory, so a loader may read from disk straight into
        KV pages instead of through a staging buffer (only this backend has it).
        np.frombuffer, not np.ctypeslib.as_array: numpy imports ctypeslib
        lazily, on the first call (0.8 ms, a disk read after a cache drop)."""
        raw = memoryview((ctypes.c_uint8 * nbytes).from_address(ptr))
        return np.frombuffer(raw, np.uint8)

    def copy_runs(
        self,
        src_ptrs: np.ndarray,
        dst_ptrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
        stream: Stream,
    ) -> None:
        native.copy_ptrs(*as_runs(src_ptrs, dst_ptrs, sizes, direction))
