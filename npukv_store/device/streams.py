"""torch.cuda / torch.npu streams and events behind the Stream and Event protocols.

Runs in: any thread of a worker that has called bind_thread().

    TorchStream - wraps torch.cuda.Stream or torch.npu.Stream; raw_handle() reads
                  the attribute that holds the runtime's stream (cuda_stream,
                  npu_stream)
    TorchEvent  - wraps torch.cuda.Event or torch.npu.Event

The two APIs have the same shape (torch_npu mirrors torch.cuda), so one wrapper
serves both; only the raw-handle attribute differs. Wrapping, rather than
handing out torch objects, gives every backend the same protocol (the CPU has
no torch stream worth using) and keeps a CUDA event from meeting an NPU stream.
"""

from __future__ import annotations

from typing import Any

from npukv_store.device.base import Event, Stream


class TorchStream:
    """A torch accelerator stream (``self.torch``)."""

    __slots__ = ("_raw_attr", "torch")

    def __init__(self, stream: Any, raw_attr: str) -> None:
        self.torch = stream
        self._raw_attr = raw_attr  # "cuda_stream" or "npu_stream"

    def wait_event(self, ev: Event) -> None:
        self.torch.wait_event(_torch_event(ev))

    def wait_stream(self, other: Stream) -> None:
        self.torch.wait_stream(_torch_stream(other))

    def raw_handle(self) -> int:
        # On the NPU this getter drains torch_npu's task queue (NPUStream::stream),
        # so work enqueued through torch (a wait_event) is launched before any raw
        # ACL call that follows: read it right before that call, never cache it.
        return int(getattr(self.torch, self._raw_attr))

    def __repr__(self) -> str:
        return f"TorchStream({self.torch!r})"


class TorchEvent:
    """A torch accelerator event (``self.torch``)."""

    __slots__ = ("torch",)

    def __init__(self, event: Any) -> None:
        self.torch = event

    def record(self, stream: Stream | None = None) -> None:
        if stream is None:
            self.torch.record()
        else:
            self.torch.record(_torch_stream(stream))

    def query(self) -> bool:
        return bool(self.torch.query())

    def synchronize(self) -> None:
        self.torch.synchronize()

    def elapsed_ms(self, end: TorchEvent) -> float:
        """Milliseconds from this event to ``end``; both need ``timing=True``."""
        return float(self.torch.elapsed_time(end.torch))


def _torch_stream(stream: Stream) -> Any:
    if not isinstance(stream, TorchStream):
        raise TypeError(f"found a {type(stream).__name__}, expected a TorchStream")
    return stream.torch


def _torch_event(ev: Event) -> Any:
    if not isinstance(ev, TorchEvent):
        raise TypeError(f"found a {type(ev).__name__}, expected a TorchEvent")
    return ev.torch
