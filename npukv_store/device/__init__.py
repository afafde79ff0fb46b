"""Device layer: streams, events, host registration and batched copies per accelerator.

Runs in: the worker process. The only package that knows which accelerator runs
(docs/architecture.md, import direction); docs/device.md holds the contract and
the facts behind it.

    get_backend(device) - the DeviceBackend for a torch.device (or "cuda:1",
                          "npu:0", "cpu"); imports that backend's module only
    base                - the protocols (Stream, Event, HostRegion, DeviceBackend)
    ordering            - the save/load ordering protocol over any backend
    cpu, cuda, npu      - one backend each; npu needs torch_npu imported
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from npukv_store.device.base import (
    REGISTER_CHUNK_BYTES,
    DeviceBackend,
    Direction,
    Event,
    HostRegion,
    Kind,
    Stream,
)
from npukv_store.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "REGISTER_CHUNK_BYTES",
    "DeviceBackend",
    "Direction",
    "Event",
    "HostRegion",
    "Kind",
    "Stream",
    "get_backend",
]

_KINDS = ("cpu", "cuda", "npu")


def _parse(device: torch.device | str) -> tuple[str, int | None]:
    """``(type, index)``; a string is parsed here because ``torch.device("npu")``
    fails until torch_npu is imported."""
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if index and not index.isdigit():
            raise ConfigError(
                f"device: found {device!r}, expected 'cpu', 'cuda[:N]' or 'npu[:N]'"
            )
        return kind, int(index) if index else None
    return str(device.type), device.index


def get_backend(device: torch.device | str) -> DeviceBackend:
    """The backend for ``device``; a device without index means the current one.

    Raises:
        ConfigError: a device type other than cpu/cuda/npu, or a cuda/npu
            device whose runtime is not there (no CUDA device; torch_npu not
            imported), naming what was found and what was expected.
    """
    kind, index = _parse(device)
    if kind == "cpu":
        from npukv_store.device.cpu import CpuBackend

        return CpuBackend()
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"device: found {device!r} but torch.cuda.is_available() is False, "
                "expected a visible CUDA device"
            )
        from npukv_store.device.cuda import CudaBackend

        return CudaBackend(torch.cuda.current_device() if index is None else index)
    if kind == "npu":
        import torch

        npu = getattr(torch, "npu", None)  # set by `import torch_npu`
        if npu is None:
            raise ConfigError(
                f"device: found {device!r} but torch has no npu module, expected "
                "torch_npu to be imported first (import torch_npu)"
            )
        from npukv_store.device.npu import NpuBackend

        return NpuBackend(int(npu.current_device()) if index is None else index)
    raise ConfigError(
        f"device: found type {kind!r} ({device!r}), expected one of {', '.join(_KINDS)}"
    )
