"""Host-range registration in chunks, with fallbacks; the HostRegion of every backend.

Runs in: the worker thread that owns the staging ring (after bind_thread()).

    chunk_ranges()     - [ptr, ptr + nbytes) cut into REGISTER_CHUNK_BYTES pieces
    Registrar          - one way to register/unregister a chunk (npurt, ACL, cudart)
    register_chunked() - the first registrar that takes every chunk wins; a
                         failure part-way unregisters its chunks and tries the
                         next; when none works: registered=False, one warning
    HostRange          - the result; close() unregisters each chunk once
    alloc_pinned()     - a small page-locked tensor, or a pageable one (warning)

Registration never raises on a runtime refusal or a missing runtime: an
unregistered ring is still correct, only its copies are synchronous (docs/device.md
§1, rule 3). Bad arguments (a zero pointer, no bytes) are bugs: ValueError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from npukv_store.device.base import REGISTER_CHUNK_BYTES

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def chunk_ranges(
    ptr: int, nbytes: int, chunk_bytes: int = REGISTER_CHUNK_BYTES
) -> list[tuple[int, int]]:
    """``(chunk_ptr, chunk_nbytes)`` covering ``[ptr, ptr + nbytes)`` in order,
    each at most ``chunk_bytes`` (the last one may be shorter)."""
    if ptr <= 0 or nbytes <= 0 or chunk_bytes <= 0:
        raise ValueError(
            f"register_host: found ptr {ptr:#x}, nbytes {nbytes} and chunks of "
            f"{chunk_bytes} bytes, expected all > 0"
        )
    return [
        (ptr + offset, min(chunk_bytes, nbytes - offset))
        for offset in range(0, nbytes, chunk_bytes)
    ]


@dataclass(frozen=True, slots=True)
class Registrar:
    """One registration path; both calls return the runtime's error code (0 ok)
    and may raise (e.g. OSError when the runtime library is missing)."""

    name: str
    register: Callable[[int, int], int]  # (chunk_ptr, chunk_nbytes) -> error code
    unregister: Callable[[int], int]  # chunk_ptr -> error code


@dataclass(slots=True, eq=False)
class HostRange:
    """A host range and the chunks of it that are registered (a HostRegion).

    ``registered`` is True when every chunk is, False when none is; it turns
    False at close(). Not thread-safe: close it from one thread.
    """

    ptr: int
    nbytes: int
    registered: bool = False
    via: str = ""  # the Registrar.name that registered it
    chunks: list[int] = field(default_factory=list)  # registered chunk pointers
    _unregister: Callable[[int], int] | None = None

    def close(self) -> None:
        """Unregister each chunk once; failures are logged, never raised."""
        chunks, self.chunks, self.registered = self.chunks, [], False
        if self._unregister is not None:
            _unregister_chunks(self.via, self._unregister, chunks)


def _unregister_chunks(
    via: str, unregister: Callable[[int], int], chunks: list[int]
) -> None:
    for chunk_ptr in chunks:
        try:
            rc = unregister(chunk_ptr)
        except Exception:  # a cleanup path: log it and go on with the rest
            logger.warning(
                "%s: unregistering chunk %#x raised", via, chunk_ptr, exc_info=True
            )
            continue
        if rc != 0:
            logger.warning(
                "%s: unregistering chunk %#x returned %d", via, chunk_ptr, rc
            )


class _Refused(Exception):
    """A registrar returned a non-zero code for a chunk."""


def _register_all(registrar: Registrar, chunks: list[tuple[int, int]]) -> list[int]:
    done: list[int] = []
    try:
        for chunk_ptr, chunk_nbytes in chunks:
            rc = registrar.register(chunk_ptr, chunk_nbytes)
            if rc != 0:
                raise _Refused(
                    f"error {rc} for the chunk at {chunk_ptr:#x} of {chunk_nbytes} "
                    f"bytes ({len(done)} of {len(chunks)} chunks registered)"
                )
            done.append(chunk_ptr)
    except BaseException:
        _unregister_chunks(registrar.name, registrar.unregister, done)
        raise
    return done


def register_chunked(
    ptr: int, nbytes: int, registrars: Sequence[Registrar], what: str
) -> HostRange:
    """Register ``[ptr, ptr + nbytes)`` chunk by chunk with the first registrar
    that takes all of it; ``registered=False`` and one warning when none does.

    Raises:
        ValueError: ``ptr`` or ``nbytes`` not > 0.
    """
    chunks = chunk_ranges(ptr, nbytes)
    failures: list[str] = []
    for registrar in registrars:
        try:
            done = _register_all(registrar, chunks)
        except Exception as exc:  # any refusal means: try the next path
            failures.append(f"{registrar.name}: {exc}")
            continue
        logger.info(
            "%s: registered %d bytes at %#x in %d chunks via %s",
            what,
            nbytes,
            ptr,
            len(done),
            registrar.name,
        )
        return HostRange(ptr, nbytes, True, registrar.name, done, registrar.unregister)
    logger.warning(
        "%s: %d bytes at %#x stay unregistered, so copies to and from them are "
        "synchronous: %s",
        what,
        nbytes,
        ptr,
        "; ".join(failures) or "no registration path",
    )
    return HostRange(ptr, nbytes)


def alloc_pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked uint8 host memory from the accelerator's host
    allocator (CUDA, torch_npu); pageable, with a warning, where pinning fails."""
    import torch

    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        logger.warning(
            "pinned host memory is unavailable; %d bytes of descriptors stay pageable",
            nbytes,
            exc_info=True,
        )
        return torch.empty(nbytes, dtype=torch.uint8)
