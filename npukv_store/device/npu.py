"""The Ascend NPU backend (docs/device.md §1.2, NPU column), on ``torch.npu``.

Runs in: worker threads that have called bind_thread(); the NPU device is
thread-local, so every thread that touches it must (torch.npu.set_device).

    NpuBackend.register_host() - in chunks of at most 64 GiB, trying in order:
          torch.npu.npurt().npuHostRegister(ptr, n, ACL_HOST_REG_PINNED) when
          torch_npu has npurt (2.14; not 2.10.0.post4), then the C extension
          (aclrtHostRegisterV2, else aclrtHostRegister MAPPED, from
          libascendcl.so); none works -> registered=False and one warning.
          Skipped on 310P (as LMCache-Ascend does).
    NpuBackend.copy_runs()     - torch.ops._C_ascend.swap_blocks_batch(src, dst,
          sizes, 0 H2D | 1 D2H) on the stream when vllm_ascend has loaded it,
          else the C extension's aclrtMemcpyAsync loop (1 H2D, 2 D2H) on the raw
          stream, read from ``npu_stream`` right before the call: that read
          drains torch_npu's task queue, so a wait_event issued through torch
          is launched before the copies (docs/device.md §3.2; to confirm on hardware).

This module is imported only by ``get_backend`` for an "npu" device and touches
``torch.npu`` only, never ``torch_npu.contrib.transfer_to_npu`` (which rewrites
torch.cuda globally), and patches nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from npukv_store import native
from npukv_store.device.base import Direction, Kind, Stream
from npukv_store.device.host import HostRange, Registrar, register_chunked
from npukv_store.device.streams import TorchStream
from npukv_store.device.torch_backend import TorchBackend

logger = logging.getLogger(__name__)

ACL_HOST_REG_PINNED = 0x10000000  # acl_rt.h; add 0x2 (MAPPED) only for device reads
_SWAP_DIRECTION = {"h2d": 0, "d2h": 1}  # vllm-ascend swap_blocks_batch
_RAW = "npu_stream"


def _ascend_swap() -> Callable[..., None] | None:
    """vllm-ascend's batched copy op, when its ``_C`` library is loaded."""
    ops: Any = torch.ops
    try:
        swap: Callable[..., None] = ops._C_ascend.swap_blocks_batch
    except (AttributeError, RuntimeError):
        return None
    return swap


class NpuBackend(TorchBackend):
    """DeviceBackend for one Ascend NPU (``torch.npu`` must exist)."""

    kind: Kind = "npu"

    def __init__(self, index: int) -> None:
        torch_any: Any = torch
        self._accel = torch_any.npu
        self.index = index
        self._swap = _ascend_swap()

    @property
    def device(self) -> torch.device:
        return torch.device("npu", self.index)

    def bind_thread(self) -> None:
        self._accel.set_device(self.index)

    def current_stream(self) -> Stream:
        return TorchStream(self._accel.current_stream(self.index), _RAW)

    def new_stream(self) -> Stream:
        # no priority: vllm-ascend reports Stream.priority_range() unsupported
        return TorchStream(self._accel.Stream(device=self.index), _RAW)

    def synchronize(self) -> None:
        self._accel.synchronize(self.index)

    def register_host(self, ptr: int, nbytes: int) -> HostRange:
        self.bind_thread()  # ACL registers for the calling thread's device
        name = self._device_name()
        if "310P" in name:  # as LMCache-Ascend does: not supported there
            logger.warning(
                "npu host registration: skipped on %s; copies are synchronous", name
            )
            return HostRange(ptr, nbytes)
        return register_chunked(
            ptr, nbytes, self._registrars(), "npu host registration"
        )

    def _device_name(self) -> str:
        get_name = getattr(self._accel, "get_device_name", None)
        try:
            return str(get_name(self.index)) if get_name is not None else ""
        except Exception:  # only used to skip 310P: an unknown name is not 310P
            return ""

    def _registrars(self) -> list[Registrar]:
        registrars = []
        if hasattr(self._accel, "npurt"):
            npurt = self._accel.npurt  # called inside: what it raises is a refusal
            registrars.append(
                Registrar(
                    "torch.npu.npurt().npuHostRegister",
                    lambda p, n: int(
                        npurt().npuHostRegister(p, n, ACL_HOST_REG_PINNED)
                    ),
                    self._bound(lambda p: int(npurt().npuHostUnregister(p))),
                )
            )
        registrars.append(
            Registrar(
                "aclrtHostRegister (npukv_store._native)",
                lambda p, n: native.acl_host_register(p, n, ACL_HOST_REG_PINNED),
                self._bound(lambda p: native.acl_host_unregister(p)),
            )
        )
        return registrars

    def _bound(self, unregister: Callable[[int], int]) -> Callable[[int], int]:
        """``unregister`` preceded by bind_thread(): close() may run in any thread."""

        def call(chunk_ptr: int) -> int:
            self.bind_thread()
            return unregister(chunk_ptr)

        return call

    def _memcpy_batch(
        self, src: np.ndarray, dst: np.ndarray, size: np.ndarray, kind: int, raw: int
    ) -> None:
        native.acl_memcpy_batch(src, dst, size, kind, raw)

    def _swap_args(self, direction: Direction) -> tuple[int, ...]:
        return (_SWAP_DIRECTION[direction],)
