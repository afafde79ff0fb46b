"""The CUDA backend (docs/device.md §1.2, CUDA column).

Runs in: worker threads that have called bind_thread() (torch.cuda.set_device).

    CudaBackend.new_stream()    - torch.cuda.Stream at priority_range()[0]
    CudaBackend.register_host() - cudaHostRegister via torch.cuda.cudart(), in
                                  chunks; a failure clears the runtime's last error
    CudaBackend.copy_runs()     - vllm._custom_ops.swap_blocks_batch on the
                                  stream when vLLM has loaded it, else the C
                                  extension's cudaMemcpyAsync loop on the raw
                                  stream (kind 1 H2D, 2 D2H)

vLLM's op is only used when ``vllm._custom_ops`` is already imported (it is in a
vLLM worker): importing vLLM here would break the rule that nothing below the
connector imports vllm (docs/architecture.md, import direction). Both paths are
asynchronous only when the host side is registered; otherwise the driver copies
synchronously.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from npukv_store import native
from npukv_store.device.base import Direction, Event, Kind, Stream, as_runs
from npukv_store.device.host import (
    HostRange,
    Registrar,
    alloc_pinned,
    register_chunked,
)
from npukv_store.device.streams import TorchEvent, TorchStream

_MEMCPY_KIND = {"h2d": 1, "d2h": 2}  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost
_RAW = "cuda_stream"
_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault, as vLLM registers


def _vllm_swap() -> Callable[..., None] | None:
    ops = sys.modules.get("vllm._custom_ops")
    swap: Callable[..., None] | None = getattr(ops, "swap_blocks_batch", None)
    return swap


class CudaBackend:
    """DeviceBackend for one CUDA device."""

    kind: Kind = "cuda"

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)
        self._cuda: Any = torch.cuda  # partly untyped (Stream, Event, cudart)
        self._swap = _vllm_swap()

    def bind_thread(self) -> None:
        self._cuda.set_device(self.device)

    def current_stream(self) -> Stream:
        return TorchStream(self._cuda.current_stream(self.device), _RAW)

    def new_stream(self) -> Stream:
        # priority_range() is (lowest, highest); vLLM's offload worker takes the
        # lowest "so KV cache I/O yields to compute streams" (docs/device.md §1.2).
        # DMA copies are not scheduled by stream priority anyway.
        lowest = self._cuda.Stream.priority_range()[0]
        return TorchStream(self._cuda.Stream(device=self.device, priority=lowest), _RAW)

    def stream_ctx(self, s: Stream) -> AbstractContextManager[None]:
        assert isinstance(s, TorchStream)
        ctx: AbstractContextManager[None] = self._cuda.stream(s.torch)
        return ctx

    def new_event(self, timing: bool = False) -> Event:
        return TorchEvent(self._cuda.Event(enable_timing=timing))

    def synchronize(self) -> None:
        self._cuda.synchronize(self.device)

    def register_host(self, ptr: int, nbytes: int) -> HostRange:
        self.bind_thread()  # flags 0 registers for the current device's context
        cudart_of = self._cuda.cudart  # called inside: what it raises is a refusal

        def register(chunk_ptr: int, chunk_nbytes: int) -> int:
            cudart = cudart_of()
            err = cudart.cudaHostRegister(
                chunk_ptr, chunk_nbytes, _HOST_REGISTER_DEFAULT
            )
            code = int(getattr(err, "value", err))
            if code != 0:
                _clear_last_error(cudart)
            return code

        def unregister(chunk_ptr: int) -> int:
            cudart = cudart_of()
            err = cudart.cudaHostUnregister(chunk_ptr)
            code = int(getattr(err, "value", err))
            if code != 0:
                _clear_last_error(cudart)
            return code

        registrar = Registrar("cudaHostRegister", register, unregister)
        return register_chunked(ptr, nbytes, [registrar], "cuda host registration")

    def is_host_registered(self, t: torch.Tensor) -> bool:
        try:
            return bool(t.is_pinned())
        except Exception:  # doubt means "not registered" (the protocol's promise)
            return False

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return alloc_pinned(nbytes)

    def copy_runs(
        self,
        src_ptrs: np.ndarray,
        dst_ptrs: np.ndarray,
        sizes: np.ndarray,
        direction: Direction,
        stream: Stream,
    ) -> None:
        src, dst, size = as_runs(src_ptrs, dst_ptrs, sizes, direction)
        assert isinstance(stream, TorchStream)
        if self._swap is not None:
            with self._cuda.stream(stream.torch):  # the op copies on the current stream
                self._swap(
                    torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(size)
                )
            return
        kind = _MEMCPY_KIND[direction]
        native.cuda_memcpy_batch(src, dst, size, kind, stream.raw_handle())


def _clear_last_error(cudart: Any) -> None:
    """Reset the runtime's last error after a failed registration, or torch's
    next kernel-launch check would report it against an unrelated kernel.
    torch.cuda.cudart() does not bind cudaGetLastError; the C extension does."""
    get_last_error = getattr(cudart, "cudaGetLastError", None)
    try:
        if get_last_error is not None:
            get_last_error()
        else:
            native.cuda_get_last_error()
    except OSError:  # no extension or no libcudart found: nothing more to do
        pass
