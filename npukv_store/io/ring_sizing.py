"""How big a staging ring is made: as configured, or (auto) what the saves need,
shrunk to what /dev/shm holds.

Runs in: the process of a store handle that saves with put_async (a vLLM
worker, at registration), once, when its ring is created.

    open_ring()    - the ring for ``ring_size`` (0: auto) and a RingRequest
    fitted_size()  - a request capped by the directory's room (statvfs)
    RingRequest    - what an auto ring should be: wanted, floor, sharers

A ring set by the operator (``ring_size`` > 0) is made as it is or refused
with one error naming ring_size: an explicit size is never changed behind the
operator's back. An auto ring never turns saving off silently: a ring smaller
than wanted is one warning line saying what to set, and a directory that
cannot hold even the floor is one ConfigError saying the same (the connector
then turns off on that worker with that line). Why: docs/decisions/0062.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from npukv_store.io.ring import ALIGN, HEADER_BYTES, RingNoRoom, StagingRing

logger = logging.getLogger(__name__)

#: ``ring_size: 0`` (auto) for a handle that says nothing of its saves
#: (put_async outside vLLM): the 1 GiB every ring had before auto sizing.
AUTO_RING_BYTES = 1 << 30
#: The smallest ring worth making for such a handle: smaller, every batch but
#: tiny ones would be dropped.
AUTO_RING_FLOOR = 1 << 20
#: The share of /dev/shm the rings of one engine take together at most:
#: vLLM's own message queues, the collective libraries and other processes of
#: the node need the rest.
SHM_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class RingRequest:
    """What an auto-sized ring (``ring_size: 0``) should be.

    Attributes:
        wanted: bytes the saves need (the connector: two steps of staging,
            :func:`npukv_store.store.sizing.ring_request`).
        floor: the smallest ring still worth making (two batches of one block).
        sharers: rings made in the same /dev/shm at about the same time (the
            engine's workers on this node): each takes at most its share.
    """

    wanted: int = AUTO_RING_BYTES
    floor: int = AUTO_RING_FLOOR
    sharers: int = 1


def open_ring(
    ring_size: int, request: RingRequest | None = None, *, directory: str = "/dev/shm"
) -> StagingRing:
    """The staging ring of a store handle (see the module docstring).

    ``ring_size`` 0 (auto) makes ``request.wanted`` bytes, or less where
    ``directory`` cannot hold them (:func:`fitted_size`), then halves on each
    refusal (ENOSPC, ENOMEM from fallocate or mmap) down to ``request.floor``.

    Raises:
        ConfigError: an explicit ring that does not fit (naming ring_size), or
            an auto ring whose floor does not (RingNoRoom, naming ring_size
            and --shm-size).
    """
    if ring_size:
        return StagingRing(ring_size, directory=directory)
    request = RingRequest() if request is None else request
    floor = max(ALIGN, min(request.floor, request.wanted))
    size, why = fitted_size(request, directory)
    size = max(size, floor)
    while True:
        try:
            ring = StagingRing(size, directory=directory)
            break
        except RingNoRoom as exc:
            why = f"a {size}-byte ring met {exc.reason}"
            if size <= floor:
                raise RingNoRoom(
                    f"ring_size: auto, found {directory} unable to hold even the "
                    f"smallest useful staging ring ({why}); expected more room "
                    f"there (docker/podman --shm-size: at least "
                    f"{request.sharers * floor} bytes for {request.sharers} "
                    "worker(s), better "
                    f"{int(request.sharers * request.wanted / SHM_SHARE)}) or "
                    "an explicit ring_size that fits",
                    exc.reason,
                ) from None
            size = max(floor, size // 2)
    if ring.size < request.wanted:
        logger.warning(
            "npukv_store: staging ring of %d bytes in %s, not the %d wanted (%s): "
            "saves beyond it are dropped and counted (dropped_blocks); give %s "
            "%d bytes for this engine's %d worker(s) (docker/podman --shm-size) "
            "or set ring_size",
            ring.size, directory, request.wanted, why, directory,
            int(request.sharers * request.wanted / SHM_SHARE), request.sharers,
        )  # fmt: skip
    return ring


def fitted_size(request: RingRequest, directory: str) -> tuple[int, str]:
    """``request.wanted``, capped by what ``directory`` holds: this ring's
    share of :data:`SHM_SHARE` of the filesystem, and what statvfs says is free
    now; with a phrase saying why when capped. A multiple of 4096, never below
    one page; the floor is the caller's."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return request.wanted, ""  # creating the ring will say what is wrong
    total = info.f_blocks * info.f_frsize
    free = info.f_bavail * info.f_frsize
    share = int(total * SHM_SHARE) // max(1, request.sharers)
    size = min(request.wanted, share, free - HEADER_BYTES)
    if size >= request.wanted:
        return request.wanted, ""
    return max(ALIGN, size // ALIGN * ALIGN), (
        f"{directory} holds {total} bytes, {free} free; the rings of "
        f"{request.sharers} worker(s) take at most {SHM_SHARE:.0%} of it"
    )
