"""The device contract (docs/device.md §1.1): what every backend provides.

Runs in: any worker thread, after ``DeviceBackend.bind_thread()`` in that thread.

    Stream, Event      - ordering primitives; a backend's own stream/event types
    HostRegion         - a host range registered (page-locked) for async copies
    DeviceBackend      - one per device: streams, events, registration, copy_runs
    as_runs()          - the three run arrays as copy_runs takes them
    REGISTER_CHUNK_BYTES - the largest range registered in one call

Layout (which bytes of which block) is device-independent and lives in
``npukv_store.connector.worker.pages``; a backend only moves
``(src_ptr, dst_ptr, nbytes)`` runs.
No backend module is imported here: ``npukv_store.device.get_backend`` imports
the one for the device at hand, so nothing NPU-specific loads without
``torch.npu``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

#: ``copy_runs`` direction: device to host (save) or host to device (load)
Direction = Literal["d2h", "h2d"]
#: ``DeviceBackend.kind``
Kind = Literal["cuda", "npu", "cpu"]

#: Host ranges are registered in chunks of at most this many bytes: a single
#: registration above ~200 GB fails on Ascend 910B (LMCache-Ascend #242) and
#: vLLM registers its CPU offload buffer in 64 GiB chunks too.
REGISTER_CHUNK_BYTES = 64 << 30


class Event(Protocol):
    """A point in a stream's work: recorded on a stream, then waited on or polled."""

    def record(self, stream: Stream | None = None) -> None:
        """Mark the work enqueued on ``stream`` (None: the current stream) so far."""

    def query(self) -> bool:
        """True once that work is done; never blocks."""

    def synchronize(self) -> None:
        """Block the calling thread until that work is done."""

    def elapsed_ms(self, end: Any) -> float:
        """Milliseconds of device time from this event to ``end`` (both made
        with ``timing=True`` and complete)."""


class Stream(Protocol):
    """An in-order queue of device work."""

    def wait_event(self, ev: Event) -> None:
        """Later work on this stream waits for ``ev`` (device side, no host wait)."""

    def wait_stream(self, other: Stream) -> None:
        """Later work on this stream waits for the work enqueued on ``other``."""

    def raw_handle(self) -> int:
        """``cudaStream_t`` / ``aclrtStream`` as an int (0 on the CPU).

        On the NPU reading it drains torch_npu's task queue, so read it right
        before a raw runtime call and after any torch-side wait on the stream.
        """


class HostRegion(Protocol):
    """A host range registered with the device runtime (or not: ``registered``).

    An unregistered range still works, but copies from or to it are
    synchronous on CUDA and Ascend.
    """

    ptr: int
    nbytes: int
    registered: bool

    def close(self) -> None:
        """Unregister every chunk; idempotent, never raises."""


class DeviceBackend(Protocol):
    """The primitives of one accelerator (or the CPU) for one device index."""

    @property
    def kind(self) -> Kind:
        """Which accelerator (a plain class attribute in every backend)."""

    @property
    def device(self) -> torch.device:
        """The device this backend drives."""

    def bind_thread(self) -> None:
        """Make this device current for the calling thread; call it first in every
        thread that touches device APIs (on Ascend the device is thread-local)."""

    def current_stream(self) -> Stream:
        """The calling thread's current (compute) stream."""

    def new_stream(self) -> Stream:
        """A new stream for transfers."""

    def stream_ctx(self, s: Stream) -> AbstractContextManager[None]:
        """Make ``s`` the current stream inside a ``with`` block."""

    def new_event(self, timing: bool = False) -> Event:
        """A new event; ``timing`` enables elapsed-time measurement where supported."""

    def synchronize(self) -> None:
        """Block until all work on the device is done."""

    def register_host(self, ptr: int, nbytes: int) -> HostRegion:
        """Page-lock ``[ptr, ptr + nbytes)`` in place, in chunks of at most
        ``REGISTER_CHUNK_BYTES``. Never raises for "unsupported" or a runtime
        error: the region then reports ``registered=False`` (one warning)."""

    def is_host_registered(self, t: torch.Tensor) -> bool:
        """Whether the runtime sees ``t``'s memory as page-locked; False on doubt."""

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        """A small page-locked uint8 host tensor (descriptor arrays), pageable
        where pinning is unavailable."""

    def copy_runs(
        self,
        src_ptrs: np.ndarray,
        dst_ptrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
        stream: Stream,
    ) -> None:
        """Enqueue ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` on
        ``stream``, asynchronous to the host where the runtime allows (the host
        side registered). The memory of every run must stay valid until an event
        recorded on ``stream`` afterwards completes. Order among the runs of one
        call is not guaranteed. The CPU backend copies synchronously.

        Raises:
            ValueError: arrays not 1-D of one length, a negative size, a zero
                address, or an unknown direction.
            OSError / RuntimeError: the runtime is missing or refused a copy.
        """


def as_runs(
    src_ptrs: np.ndarray, dst_ptrs: np.ndarray, sizes: np.ndarray, direction: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The run arrays as C-contiguous int64, after checking ``direction`` and
    that they are 1-D of one length (the entries are checked by the copy)."""
    if direction not in ("d2h", "h2d"):
        raise ValueError(
            f"copy_runs: direction is {direction!r}, expected 'd2h' or 'h2d'"
        )
    arrays = tuple(
        np.ascontiguousarray(a, dtype=np.int64) for a in (src_ptrs, dst_ptrs, sizes)
    )
    shapes = [a.shape for a in arrays]
    if any(len(shape) != 1 for shape in shapes) or len(set(shapes)) != 1:
        raise ValueError(
            f"copy_runs: src_ptrs, dst_ptrs and sizes have shapes {shapes}, expected "
            "three 1-D arrays of one length"
        )
    return arrays[0], arrays[1], arrays[2]
