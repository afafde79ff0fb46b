"""What the torch-backed backends (CUDA, NPU) share: the batched copy of runs
and the calls that read the same on ``torch.cuda`` and ``torch.npu``.

Runs in: worker threads that have called bind_thread().

    TorchBackend.copy_runs() - the framework's batched copy op on the stream
                               where it is loaded (``_swap``: vLLM's or
                               vllm-ascend's swap_blocks_batch), else the C
                               extension's memcpy loop on the raw stream
                               (kind 1 H2D, 2 D2H)

A subclass sets ``_accel`` (``torch.cuda`` or ``torch.npu``: torch_npu mirrors
torch.cuda's API) and ``_swap``, and says how its runtime copies
(``_memcpy_batch``) and what else its op takes (``_swap_args``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from npukv_store.device.base import Direction, Event, Stream, as_runs
from npukv_store.device.host import alloc_pinned
from npukv_store.device.streams import TorchEvent, TorchStream

#: cudaMemcpyHostToDevice / ACL_MEMCPY_HOST_TO_DEVICE and the device-to-host
#: kind: the same numbers in both runtimes
_MEMCPY_KIND = {"h2d": 1, "d2h": 2}


class TorchBackend:
    """The shared half of CudaBackend and NpuBackend."""

    _accel: Any  # torch.cuda or torch.npu, partly untyped (Stream, Event, rt)
    _swap: Callable[..., None] | None

    def _memcpy_batch(
        self, src: np.ndarray, dst: np.ndarray, size: np.ndarray, kind: int, raw: int
    ) -> None:
        """The C extension's copy loop of this runtime on raw stream ``raw``."""
        raise NotImplementedError

    def _swap_args(self, direction: Direction) -> tuple[int, ...]:
        """What the swap op takes after the three run tensors."""
        del direction
        return ()

    def stream_ctx(self, s: Stream) -> AbstractContextManager[None]:
        assert isinstance(s, TorchStream)
        ctx: AbstractContextManager[None] = self._accel.stream(s.torch)
        return ctx

    def new_event(self, timing: bool = False) -> Event:
        return TorchEvent(self._accel.Event(enable_timing=timing))

    def is_host_registered(self, t: torch.Tensor) -> bool:
        # On the NPU is_pinned() asks aclrtPointerGetAttributes, reported to
        # fail on non-ACL host memory (Mooncake #4046): doubt means "not
        # registered" (the protocol's promise).
        try:
            return bool(t.is_pinned())
        except Exception:
            return False

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return alloc_pinned(nbytes)  # the framework's pinned host allocator

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
            with self._accel.stream(
                stream.torch
            ):  # the op copies on the current stream
                self._swap(
                    torch.from_numpy(src),
                    torch.from_numpy(dst),
                    torch.from_numpy(size),
                    *self._swap_args(direction),
                )
            return
        self._memcpy_batch(src, dst, size, _MEMCPY_KIND[direction], stream.raw_handle())
