"""A grow-only, page-aligned host buffer registered with the device.

Runs in: the worker process (the loader's reader threads and the remote
loads). One class for the loader's per-layer slots and the remote tier's load
buffer: both grow to the largest load seen, and both must be registered
(pinned) for the device's H2D copies to run asynchronously.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_HOST_ALIGN = 4096


class HostBuffer:
    """``ensure(nbytes)`` gives ``nbytes`` of it, reallocating (and
    registering again) only when it must grow. Subclasses add what else must
    know the memory (``_registered`` / ``_unregistering``)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._raw = np.empty(0, dtype=np.uint8)
        self.view = self._raw
        self._region: Any = None

    def ensure(self, nbytes: int) -> np.ndarray:
        if self.view.size < nbytes:
            self.close()
            self._raw = np.empty(nbytes + _HOST_ALIGN, dtype=np.uint8)
            skip = -self._raw.ctypes.data % _HOST_ALIGN
            self.view = self._raw[skip : skip + nbytes]
            self._registered(self.view)
            self._region = self._backend.register_host(self.view.ctypes.data, nbytes)
        return self.view[:nbytes]

    def _registered(self, view: np.ndarray) -> None:
        """New memory, before the device registers it."""

    def _unregistering(self, view: np.ndarray) -> None:
        """Memory about to be given back."""

    def close(self) -> None:
        if self._region is not None:
            self._unregistering(self.view)
            self._region.close()
            self._region = None
