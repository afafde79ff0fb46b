"""The CUDA backend (docs/device.md §1.2, CUDA column).

Runs in: worker threads that have called bind_thread() (torch.cuda.set_device).

    CudaBackend.new_stream()    - torch.cuda.Stream at priority_range()[0]
    CudaBackend.register_host() - cudaHostRegister via torch.cuda.cudart(), in
                                  chunks; a failure clears the runtime's last error
    CudaBackend.copy_runs()     - vllm._custom_ops.swap_blocks_batch on the
                                  stream when vLLM has loaded it, else the C
                                  extension's cudaMemcpyAsync loop on the raw
                                  stream (:mod:`.torch_backend`)

vLLM's op is only used when ``vllm._custom_ops`` is already imported (it is in a
vLLM worker): importing vLLM here would break the rule that nothing below the
connector imports vllm (docs/architecture.md, import direction). Both paths are
asynchronous only when the host side is registered; otherwise the driver copies
synchronously.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from npukv_store import native
from npukv_store.device.base import Kind, Stream
from npukv_store.device.host import HostRange, Registrar, register_chunked
from npukv_store.device.streams import TorchStream
from npukv_store.device.torch_backend import TorchBackend

_RAW = "cuda_stream"
_HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault, as vLLM registers


def _vllm_swap() -> Callable[..., None] | None:
    ops = sys.modules.get("vllm._custom_ops")
    swap: Callable[..., None] | None = getattr(ops, "swap_blocks_batch", None)
    return swap


class CudaBackend(TorchBackend):
    """DeviceBackend for one CUDA device."""

    kind: Kind = "cuda"

    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)
        self._accel = torch.cuda  # partly untyped (Stream, Event, cudart)
        self._swap = _vllm_swap()

    def bind_thread(self) -> None:
        self._accel.set_device(self.device)

    def current_stream(self) -> Stream:
        return TorchStream(self._accel.current_stream(self.device), _RAW)

    def new_stream(self) -> Stream:
        # priority_range() is (lowest, highest); vLLM's offload worker takes the
        # lowest "so KV cache I/O yields to compute streams" (docs/device.md §1.2).
        # DMA copies are not scheduled by stream priority anyway.
        lowest = self._accel.Stream.priority_range()[0]
        return TorchStream(
            self._accel.Stream(device=self.device, priority=lowest), _RAW
        )

    def synchronize(self) -> None:
        self._accel.synchronize(self.device)

    def register_host(self, ptr: int, nbytes: int) -> HostRange:
        self.bind_thread()  # flags 0 registers for the current device's context
        cudart_of = self._accel.cudart  # called inside: what it raises is a refusal

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

    def _memcpy_batch(
        self, src: np.ndarray, dst: np.ndarray, size: np.ndarray, kind: int, raw: int
    ) -> None:
        native.cuda_memcpy_batch(src, dst, size, kind, raw)


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
