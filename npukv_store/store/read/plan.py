"""How one chunk's rows are read: a plan made before any byte moves.

Runs in: any process that reads; pure (no file, no syscall, no thread), so every
choice is tested without files and printed by ``npukv inspect --plan``.

    ReadTuning        - every read threshold in one table, each with its measurement
    Route             - the four ways a layer is read
    plan_chunk_read() - one route per layer, with its reason, and the engine requests
    whole_chunk_plan() - the plan of reading all of a chunk (npukv inspect --plan)
    ChunkReadPlan     - that plan; ``explain()`` is its short text

Decision N is docs/decisions/N-*.md. The routes, in the order the planner
tries them (decisions 0013, 0018, 0019, 0020):

  cached    the layer is wholly in the page cache: read and hashed in one pass
            over memory on the verifier threads (``native.pread_layers_xxh3``)
  direct    first read of the chunk, aligned, the cache holds little of it:
            O_DIRECT through the I/O engine, around the page cache
  streamed  read buffered, not wholly cached, in segments larger than one
            engine request: one thread in file order, hashing as it reads, with
            kernel readahead ahead of it
  engine    everything else: buffered requests through the I/O engine, each
            layer verified as soon as its last request completes
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from npukv_store import native
from npukv_store.io.direct import DIRECT_ALIGN_BYTES, aligned_buffer
from npukv_store.store.arrays import DestRows
from npukv_store.store.format import ChunkHeader
from npukv_store.store.read.rows import ChunkRows


def _default_verify_threads() -> int:
    return min(8, max(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class ReadTuning:
    """Every threshold of the read path. The measurements behind them were
    taken on two hosts: "vm", a 2-core VM with a virtio disk (1.5-2.0 GB/s
    cold), and "h200", a 16-core H200 host with a virtio disk too; each field
    names its host and the decision record (docs/decisions/) with the numbers."""

    #: A range with at least this share of its pages cached is read buffered:
    #: copying it from the cache beats a device read (vm; decision 0012).
    cached_share: float = 0.5
    #: Vectored reads carry at most this many bytes and buffers: 4 MiB requests
    #: beat 1 MiB per-tensor segments by about 12% cold (vm; decision 0013).
    max_request_bytes: int = 4 << 20
    max_iovecs: int = 64
    #: Buffered layers not wholly cached, in segments above this, are streamed;
    #: several huge engine requests at far-apart offsets of one file ran up to
    #: 2x slower cold than one stream (vm; decision 0019).
    stream_above_bytes: int = 4 << 20
    #: False: no layer is streamed (the engine reads them; A/B runs).
    stream_uncached: bool = True
    #: Verifier threads. pread_rows_xxh3 from the page cache gave 4.1, 10.1 and
    #: 15.0 GB/s on 1, 4 and 8 threads (h200; decision 0016); at least 4 even on 2
    #: cores: warm 1 GiB reads at 6.56/6.85 GB/s against 6.03/6.47 with 2 (vm).
    verify_threads: int = field(default_factory=_default_verify_threads)
    #: Cached layers of a chunk go in this many verifier tasks of consecutive
    #: layers (0 = verify_threads): warm 1 GiB reads of 32-layer chunks, 5.75
    #: against 5.47 GB/s with one task per layer (vm; decision 0019).
    cached_tasks_per_chunk: int = 0
    #: Chunks of one read call in flight: three, as headers are read ahead;
    #: cold 1 GiB reads 1.523 against 1.451 GB/s with two (vm; decision 0020).
    chunks_in_flight: int = 3
    #: POSIX_FADV_SEQUENTIAL on buffered chunk fds doubles the readahead window
    #: of a freshly opened file: +10-15% cold (vm; decision 0013).
    sequential_advice: bool = True
    #: Parsed headers kept (chunk files are immutable, ids never reused), and
    #: chunk ids remembered as read once (the page-cache admission set).
    header_cache_entries: int = 1024
    read_before_entries: int = 65536
    #: The first read of a chunk goes O_DIRECT (with ``direct_io``): True or
    #: False forces it; None follows the cache directory's calibration of its
    #: disk (store/calibration.py; decision 0063), and O_DIRECT without one
    #: (vm: 1.9 GB/s O_DIRECT against 1.3-1.6 buffered cold; decision 0012).
    direct_first_reads: bool | None = None
    #: A namespace every TP worker loads (MLA under TP > 1) is read buffered,
    #: so the disk serves a hit once, not once per worker: 1.00x against 4.00x
    #: the hit's bytes with 4 workers (vm; decision 0063). False: A/B runs.
    buffered_when_shared: bool = True
    #: Every layer takes this route where it can (A/B runs and the tests that
    #: compare routes); ``direct`` still needs an aligned range and O_DIRECT.
    only_route: Route | None = None
    #: The C code hashes parts from this size through an L2-sized bounce buffer
    #: (native/checksum.c); read-only here, shown so that one table has it.
    BOUNCE_ABOVE_BYTES = native.BOUNCE_ABOVE_BYTES

    @property
    def cached_tasks(self) -> int:
        return self.cached_tasks_per_chunk or self.verify_threads


class Route(enum.Enum):
    CACHED = "cached"
    DIRECT = "direct"
    STREAMED = "streamed"
    ENGINE = "engine"


class Segment(NamedTuple):
    """One tensor's bytes of a run of rows: a file range and its destination."""

    offset: int
    first: int  # key index of the first row
    num_rows: int
    dest: np.ndarray


@dataclass(frozen=True)
class LayerRead:
    layer: int
    route: Route
    reason: str
    segments: tuple[Segment, ...]
    direct: tuple[bool, ...]  # per segment: read with O_DIRECT
    cached_share: float  # the smallest share of any segment (0 when unknown)


@dataclass(frozen=True)
class EngineRequest:
    """One (vectored) engine request: segments that follow each other in the
    file, all on the O_DIRECT fd or all on the buffered one."""

    direct: bool
    parts: tuple[tuple[int, Segment], ...]  # (position in plan.layers, segment)

    @property
    def offset(self) -> int:
        return self.parts[0][1].offset


@dataclass(frozen=True)
class ChunkReadPlan:
    layers: tuple[LayerRead, ...]
    cached_tasks: tuple[tuple[int, ...], ...]  # layer indices per verifier task
    streamed: tuple[int, ...]  # layer indices, in file order
    requests: tuple[EngineRequest, ...]
    readahead: bool  # some range is read buffered: the fd wants readahead
    residency_known: bool

    @property
    def direct_bytes(self) -> int:
        return sum(s.dest.nbytes for r in self.requests if r.direct for _, s in r.parts)

    def routes(self) -> dict[int, Route]:
        return {layer.layer: layer.route for layer in self.layers}

    def explain(self) -> str:
        """A few lines: per route its layers and bytes, and each distinct reason."""
        lines = []
        for route in Route:
            chosen = [lr for lr in self.layers if lr.route is route]
            if not chosen:
                continue
            nbytes = sum(s.dest.nbytes for lr in chosen for s in lr.segments)
            reasons = sorted({lr.reason for lr in chosen})
            lines.append(
                f"{route.value:8} layers {_ranges([lr.layer for lr in chosen])}"
                f" ({nbytes / 2**20:.1f} MiB): {'; '.join(reasons)}"
            )
        lines.append(
            f"engine requests {len(self.requests)}"
            f" ({sum(r.direct for r in self.requests)} direct),"
            f" cached tasks {len(self.cached_tasks)},"
            f" residency {'known' if self.residency_known else 'unknown'}"
        )
        return "\n".join(lines)


#: Per segment, the share of its pages the page cache holds; None where the
#: filesystem cannot say. Given ``(offset, length)`` rows.
Residency = Callable[[np.ndarray], "np.ndarray | None"]


def layer_segments(
    header: ChunkHeader, rows: ChunkRows, li: int, dest: Mapping[str, DestRows]
) -> list[Segment]:
    """Reads of layer ``li``: one per run of consecutive rows that land in
    consecutive destination rows, per tensor; sorted by file offset."""
    segments = [
        Segment(
            entry.begin + row * entry.row_bytes,
            i,
            count,
            dest[entry.name][i : i + count],
        )
        for entry in header.layers[li]
        for i, row, count in rows.runs
    ]
    segments.sort(key=lambda segment: segment.offset)
    return segments


def plan_chunk_read(
    header: ChunkHeader,
    rows: ChunkRows,
    layers: Sequence[int],
    dest: Mapping[str, DestRows],
    residency: Residency,
    tuning: ReadTuning,
    *,
    first_read: bool,
    verify: bool,
) -> ChunkReadPlan:
    """The route of every layer in ``layers`` and the engine's requests.

    Args:
        residency: asked once, for every segment's range.
        first_read: O_DIRECT is allowed (direct I/O on, the first read of this
            chunk by this reader, and the filesystem has not refused it).
        verify: checksums are compared; unverified cached layers are copied by
            the engine's workers in parallel rather than hashed.
    """
    per_layer = [layer_segments(header, rows, li, dest) for li in layers]
    flat = [segment for segments in per_layer for segment in segments]
    ranges = np.array([(s.offset, s.dest.nbytes) for s in flat], np.int64).reshape(
        -1, 2
    )
    found = residency(ranges) if flat else np.zeros(0)
    # unknown: treat as uncached, which is what the reads find out anyway
    shares: list[float] = (
        [0.0] * len(flat) if found is None else np.asarray(found, float).tolist()
    )
    only = tuning.only_route
    # O_DIRECT only where residency is known: reading around a cache that
    # holds the range costs a device read where a copy would do
    first_read = first_read and found is not None
    plans: list[LayerRead] = []
    seen = 0
    for li, segments in zip(layers, per_layer, strict=True):
        share = shares[seen : seen + len(segments)]
        seen += len(segments)
        plans.append(_route(li, segments, share, tuning, only, first_read, verify))
    cached = [lr.layer for lr in plans if lr.route is Route.CACHED]
    tasks = min(len(cached), tuning.cached_tasks)
    streamed = sorted(
        (lr for lr in plans if lr.route is Route.STREAMED),
        key=lambda lr: lr.segments[0].offset if lr.segments else 0,
    )
    engine = [
        (pos, segment, direct)
        for pos, lr in enumerate(plans)
        if lr.route in (Route.ENGINE, Route.DIRECT)
        for segment, direct in zip(lr.segments, lr.direct, strict=True)
    ]
    return ChunkReadPlan(
        layers=tuple(plans),
        cached_tasks=tuple(
            tuple(cached[t * len(cached) // tasks : (t + 1) * len(cached) // tasks])
            for t in range(tasks)
        ),
        streamed=tuple(lr.layer for lr in streamed),
        requests=tuple(_requests(engine, tuning)),
        readahead=bool(streamed) or any(not direct for _, _, direct in engine),
        residency_known=found is not None,
    )


def whole_chunk_plan(
    header: ChunkHeader,
    residency: Residency,
    tuning: ReadTuning,
    *,
    first_read: bool,
    verify: bool,
) -> ChunkReadPlan:
    """The plan of a read of every row and layer of a chunk into page-aligned
    buffers, as the staging ring's are (``npukv inspect --plan``)."""
    n = header.num_blocks
    dest: dict[str, DestRows] = {
        e.name: aligned_buffer(n * e.row_bytes).reshape(n, e.row_bytes)
        for layer in header.layers
        for e in layer
    }
    return plan_chunk_read(
        header, ChunkRows([(r, r) for r in range(n)]), range(len(header.layers)),
        dest, residency, tuning, first_read=first_read, verify=verify,
    )  # fmt: skip


def _route(
    li: int,
    segments: list[Segment],
    shares: list[float],
    tuning: ReadTuning,
    only: Route | None,
    first_read: bool,
    verify: bool,
) -> LayerRead:
    share = min(shares) if shares else 1.0
    buffered = (False,) * len(segments)

    def layer(
        route: Route, reason: str, direct: tuple[bool, ...] = buffered
    ) -> LayerRead:
        return LayerRead(li, route, reason, tuple(segments), direct, share)

    if only is Route.CACHED or (only is None and verify and share == 1.0):
        return layer(Route.CACHED, "forced" if only else "wholly in the page cache")
    if only is None and share == 1.0:
        return layer(Route.ENGINE, "cached, unverified: the engine's workers copy it")
    if first_read and only in (None, Route.DIRECT):
        direct = tuple(
            # around the cache only where it mostly lacks the range (a cached
            # range is cheaper to copy than to read again), and O_DIRECT
            # needs offset, length and address aligned
            s < tuning.cached_share and _aligned(seg)
            for seg, s in zip(segments, shares, strict=True)
        )
        if all(direct):
            return layer(
                Route.DIRECT,
                "forced" if only else "first read, aligned, not cached",
                direct,
            )
        if any(direct):
            why = f"{sum(direct)} of {len(direct)} ranges direct"
            why += " (the rest cached or unaligned)"
            return layer(Route.ENGINE, why, direct)
    largest = max((s.dest.nbytes for s in segments), default=0)
    if only is Route.STREAMED or (
        only is None and tuning.stream_uncached and largest > tuning.stream_above_bytes
    ):
        reason = (
            "forced" if only else f"buffered, ranges of {_mib(largest)} > one request"
        )
        return layer(Route.STREAMED, reason)
    if only is not None:
        return layer(
            Route.ENGINE,
            "forced" if only is Route.ENGINE else f"{only.value} not possible",
        )
    if not first_read:
        return layer(Route.ENGINE, "buffered (read before, or direct I/O off)")
    return layer(Route.ENGINE, "buffered (unaligned or mostly cached)")


def _aligned(segment: Segment) -> bool:
    unaligned = segment.offset | segment.dest.nbytes | segment.dest.ctypes.data
    return unaligned % DIRECT_ALIGN_BYTES == 0


def _requests(
    engine: list[tuple[int, Segment, bool]], tuning: ReadTuning
) -> list[EngineRequest]:
    """Segments grouped into requests, in file order: direct segments whose
    file ranges follow each other share one vectored read, up to the request
    limits; every buffered segment is a request of its own. Cold chunks then go
    to the disk in 4 MiB requests whatever the destination tensors are, while
    cached segments stay separate requests, which io_uring's workers copy on
    several cores (warm 4.6 against 6.9 GB/s unverified; vm; decision 0013)."""
    order = sorted(engine, key=lambda e: (e[2], e[1].offset))
    groups: list[list[tuple[int, Segment, bool]]] = []
    end = size = -1
    for entry in order:
        _, segment, direct = entry
        nbytes = segment.dest.nbytes
        group = groups[-1] if groups else None
        if (
            group is not None
            and direct
            and group[0][2]
            and segment.offset == end
            and size + nbytes <= tuning.max_request_bytes
            and len(group) < tuning.max_iovecs
        ):
            group.append(entry)
            size += nbytes
        else:
            groups.append([entry])
            size = nbytes
        end = segment.offset + nbytes
    return [EngineRequest(g[0][2], tuple((p, s) for p, s, _ in g)) for g in groups]


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
