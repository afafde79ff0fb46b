"""The maintenance job: garbage, verification, eviction and compaction of one
cache directory, safe while servers use it. Its command line is
:mod:`npukv_store.cli.compact`, run by ``scripts/compact.py`` and ``npukv
compact|gc``.

Runs in: its own process (cron, a systemd timer, an operator's shell), beside
live vLLM servers. One run at a time per directory (``maintenance.lock``, an
flock: a killed run's lock is released by the kernel, so the next run takes it
over).

Steps, in this order (each also works alone):
    gc       tmp/ files of dead writers, orphan chunk files, files of unpublished
             chunks whose unlink never happened, rows whose file is gone,
             staging rings of dead processes in /dev/shm, dead save claims;
             then the records of sessions that died without closing (an
             open scans only while one is left: docs/decisions/0059)
    verify   (``--verify``) read every live block and check its checksums; a bad
             chunk moves to quarantine/ and its rows are dropped
    evict    (``--target F``) the oldest chunks, down to F of capacity
    compact  rewrite chunks whose live fraction is below ``--min-live``, and merge
             small chunks of one namespace up to ``chunk_target_size``
    calibrate measure the disk's cold reads once per device, where
             ``calibration.json`` has none for it (store/calibration.py): the
             servers' first reads follow it (docs/decisions/0063)

Compaction publishes like the writer: the new chunk is written to tmp/, fsynced,
renamed into place, then one index transaction moves the rows to it and
unpublishes the old chunks; the old files are unlinked only after that commit. A
reader that located a row in an old chunk reads it from the still-open file or
finds the file gone (a miss); chunk ids are never reused, so it never reads other
bytes. A kill at any step leaves what a killed writer leaves (a tmp/ file, an
orphan, a tombstoned file), which the next run or any opening process removes.

Every file it touches is inside the cache directory, reached from the root's
descriptor without following a symlink (:mod:`npukv_store.store.dirfd`). Run
as root, it refuses a directory root does not own: ``--as-owner`` (the
command line) makes it that user first.

Exit codes: 0 nothing was wrong; 1 problems were found (and fixed, unless
``--dry-run``); 2 unusable arguments or directory, or another run holds the lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from npukv_store.config import StoreConfig
from npukv_store.errors import ConfigError, FormatError, NpuKVError
from npukv_store.io.ring import stale_rings
from npukv_store.store import calibration, compaction, recovery, sessions
from npukv_store.store.check import chunk_file_problems
from npukv_store.store.claims import ClaimTable
from npukv_store.store.directory import MARKER, CacheDir
from npukv_store.store.index import Index
from npukv_store.store.locks import open_lock_file
from npukv_store.store.permissions import check_tool_root
from npukv_store.store.pins import decode_pins
from npukv_store.store.policy import excess_bytes
from npukv_store.store.publish import Publisher
from npukv_store.store.sizing import recorded_map_size
from npukv_store.store.stats import StoreCounters

logger = logging.getLogger("npukv.maintenance")
#: The index's address space, as every store handle reserves it by default:
#: the least maintenance opens it with (store.sizing.recorded_map_size).
_MAP_SIZE: int = StoreConfig.__dataclass_fields__["index_map_size"].default  # type: ignore[assignment]


#: The scratch file the disk is measured on, once per device (a few hundred ms).
CALIBRATION_SAMPLE = 64 << 20


class MaintenanceBusy(NpuKVError):
    """Another maintenance run holds the directory's maintenance lock."""


@dataclass(frozen=True)
class Options:
    """What one run does (see the module docstring and ``--help``)."""

    cache_dir: str
    dry_run: bool = False
    target: float | None = None
    min_live: float = 0.5
    verify: bool = False
    gc_only: bool = False
    compact: bool = True  # False: repairs only (npukv verify --fix)
    rebuild_index: bool = False
    capacity: int | None = None
    ring_dir: str = "/dev/shm"
    grace_s: float | None = None  # None: StoreConfig's evict_grace_s
    chunk_size: int | None = None  # None: StoreConfig's chunk_target_size


@dataclass
class Summary:
    """What a run found and did; ``--json`` prints it."""

    chunks_before: int = 0
    chunks_after: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    rewritten: int = 0  # old chunks whose rows moved to a new chunk
    written: int = 0  # new chunks compaction wrote
    evicted: int = 0
    orphans_removed: int = 0
    tmp_removed: int = 0
    tombstones_cleared: int = 0
    missing_dropped: int = 0
    rings_removed: int = 0
    claims_swept: int = 0
    pins_expired: int = 0  # pins past their --ttl, removed (their blocks unpinned)
    quarantined: int = 0
    #: "kept" (this device's calibration was there), "measured", "busy"
    #: (another process was measuring), "failed" (logged; constants apply),
    #: "" (not this run's step: dry run, gc only, repairs only)
    calibration: str = ""
    quarantined_chunks: list[str] = field(default_factory=list)
    dry_run: bool = False
    seconds: float = 0.0

    @property
    def problems(self) -> int:
        """Crash leftovers and corruption found: what makes the exit code 1."""
        return (
            self.orphans_removed + self.tmp_removed + self.tombstones_cleared
            + self.missing_dropped + self.rings_removed + self.quarantined
        )  # fmt: skip


@contextlib.contextmanager
def maintenance_lock(cdir: CacheDir) -> Iterator[None]:
    """Hold the directory's maintenance lock, or raise :class:`MaintenanceBusy`
    at once (a run never waits for another: the next timer tick retries).

    Raises:
        MaintenanceBusy: another run holds it.
        UnsafeEntry: maintenance.lock is a symlink, a hard link or someone
            else's: it is never opened through, nor truncated.
    """
    fd = open_lock_file(cdir, "maintenance.lock")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            # what another run wrote, printable only (it reaches a terminal)
            holder = "".join(c for c in text if c.isprintable()) or "?"
            raise MaintenanceBusy(
                f"{cdir.maintenance_lock}: held by pid {holder}, expected no other "
                "maintenance run on this directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above
        yield
    finally:
        os.close(fd)


Progress = Callable[[str, int], None]


def run(options: Options, progress: Progress | None = None) -> Summary:
    """One maintenance run over ``options.cache_dir``.

    Args:
        progress: called as ``progress(step, items)`` when a step starts and
            ``progress("", 1)`` per item done (the CLI draws a bar from it).

    Raises:
        ConfigError: the directory is not an npukv cache, or an option is unusable.
        MaintenanceBusy: another run holds the lock.
    """
    started = time.monotonic()
    cdir = open_cache(options.cache_dir)
    summary = Summary(dry_run=options.dry_run)
    tick = progress or (lambda step, items: None)
    with maintenance_lock(cdir):
        # the servers' map size, not the default: their headroom (0062)
        map_size = recorded_map_size(cdir, _MAP_SIZE)
        # Both take .lock themselves, exclusive only to swap a rebuilt index
        # in: servers open and serve while a rebuild's batches commit (0059).
        if options.rebuild_index and not options.dry_run:
            recovery.rebuild_index(cdir, map_size=map_size, sync=True).close()
        index = recovery.open_index(cdir, map_size=map_size, sync=True)
        claims = ClaimTable(cdir.claims_path, access=cdir.access)
        try:
            config = _config(cdir, options, index)
            publisher = Publisher(cdir, index, claims, config, StoreCounters())
            total, summary.chunks_before, _ = index.totals()
            summary.bytes_before = total
            collect_garbage(cdir, publisher, options, summary)
            summary.pins_expired = _expire_pins(index, dry_run=options.dry_run)
            if not options.gc_only:
                if options.verify:
                    _verify(cdir, publisher, options, summary, tick)
                if options.target is not None:
                    _evict(publisher, config, options, summary)
                if options.compact:
                    compaction.compact(
                        cdir, publisher, config, options.min_live, summary,
                        dry_run=options.dry_run, tick=tick,
                    )  # fmt: skip
            publisher.forget_unlinked()
            if options.compact and not (options.gc_only or options.dry_run):
                summary.calibration = _calibrate(cdir)
            total, summary.chunks_after, _ = index.totals()
            summary.bytes_after = total
        finally:
            claims.close()
            index.close()
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


def _calibrate(cdir: CacheDir) -> str:
    """Measure the disk once per device (calibration.ensure). Never fails the
    run: without a calibration the read routes fall back to the constants."""
    if calibration.load(cdir) is not None:
        return "kept"
    try:
        found = calibration.ensure(cdir, CALIBRATION_SAMPLE)
        return "measured" if found is not None else "busy"
    except OSError as exc:  # a full or read-only disk: constants meanwhile
        logger.warning("calibration of %s failed (read routes from constants): %s",
                       cdir.root, exc)  # fmt: skip
        return "failed"


def open_cache(path: str) -> CacheDir:
    """The existing cache at ``path``, for a tool: root, entries and marker
    checked, nothing created; the access the root was made with.

    Raises:
        ConfigError: no marker, an unsafe root or entry, or (run as root) a
            root that root does not own (``--as-owner`` acts as its owner).
        OSError: it is missing or unreadable.
    """
    cdir = CacheDir(path)
    try:
        cdir.open_root(create=False)
    except FileNotFoundError:
        raise ConfigError(
            f"cache_dir: {cdir.root} does not exist; expected an npukv cache "
            f"(a directory with its {MARKER} marker)"
        ) from None
    assert cdir.root_stat is not None  # set by open_root
    check_tool_root(cdir.root, cdir.root_stat)
    cdir.open_existing()
    return cdir


def _config(cdir: CacheDir, options: Options, index: Index) -> StoreConfig:
    """The settings maintenance works to: the servers' capacity (recorded in the
    index by their commits) unless ``--capacity`` overrides it."""
    capacity = options.capacity
    if capacity is None:
        capacity = index.recorded_capacity()
    if capacity is None and options.target is not None:
        raise ConfigError(
            "--target: no capacity recorded in the index yet (no server has "
            "committed a chunk); expected --capacity SIZE"
        )
    gid = cdir.access.gid
    config = StoreConfig(
        cache_dir=cdir.root,
        verify="always",
        cache_group="" if gid is None else str(gid),  # the root's own
        lock_timeout_s=cdir.lock_timeout_s,
    )
    if capacity is not None:
        config = dataclasses.replace(config, capacity=capacity)
    if options.grace_s is not None:
        config = dataclasses.replace(config, evict_grace_s=options.grace_s)
    if options.chunk_size is not None:
        config = dataclasses.replace(config, chunk_target_size=options.chunk_size)
    return config


def _expire_pins(index: Index, *, dry_run: bool) -> int:
    """Remove the pins past their expiry (servers do too, within a second,
    while they run); how many."""
    now = time.time_ns()
    expired = []
    for pin_id, pin in decode_pins(index.pin_records()).items():
        if isinstance(pin, FormatError):  # left for the operator: npukv unpin ID
            logger.warning("%s", pin)
        elif pin.expired(now):
            expired.append(pin_id)
    if dry_run:
        return len(expired)
    return sum(index.unpin(pin_id) for pin_id in expired)


def collect_garbage(
    cdir: CacheDir, publisher: Publisher, options: Options, summary: Summary
) -> None:
    """Remove what crashes leave behind (see the module docstring). Files of live
    processes stay: they may be a publish in flight."""
    index = publisher.index
    max_age = publisher.config.tmp_max_age_s
    # Sessions dead before the scan begins: what they left, it finds, so an
    # open no longer needs to scan for them (forgotten at the end).
    dead_sessions = sessions.dead_sessions(cdir)
    tmp = cdir.garbage_tmp(max_age)
    dead = index.dead_chunks()
    scan = recovery.scan_orphans(cdir, index, max_age)
    tombstoned = [p for p in scan.removable if recovery.chunk_id_of(p) in dead]
    summary.tmp_removed = len(tmp)
    summary.orphans_removed = len(scan.removable) - len(tombstoned)
    summary.tombstones_cleared = len(tombstoned)
    # Rows whose file is gone: the file is checked first, the index after, as
    # eviction unpublishes before it unlinks (a chunk evicted meanwhile is not
    # missing, it is gone).
    missing = [
        r.chunk_id
        for r in index.iter_chunks()
        if cdir.lstat(cdir.chunk_path(r.namespace.hex(), r.chunk_id)) is None
        and index.chunk(r.chunk_id) is not None
    ]
    summary.missing_dropped = len(missing)
    rings = stale_rings(options.ring_dir)
    summary.rings_removed = len(rings)
    if options.dry_run:
        return
    for path in tmp + scan.removable:
        cdir.unlink_quietly(path)  # relative to the root fd: links themselves
    for path in rings:  # /dev/shm, not the cache: stale_rings checked them
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if missing:  # quarantined by a reader killed before its commit, or deleted
        index.remove_chunks(missing)
    recovery.forget_gone_tombstones(cdir, index)
    sessions.forget_sessions(cdir, dead_sessions)
    # records of the first form of 0059, in the index: nobody reads them now
    index.forget_meta(index.meta_records(b"session/"))
    summary.claims_swept = publisher.claims.sweep()


def _verify(
    cdir: CacheDir,
    publisher: Publisher,
    options: Options,
    summary: Summary,
    tick: Callable[[str, int], None],
) -> None:
    records = list(publisher.index.iter_chunks())
    tick("verify", len(records))
    bad = []
    for record in records:
        try:
            problems = chunk_file_problems(cdir, record, verify_data=True)
        except OSError as exc:  # EIO: the file is as bad as a wrong checksum
            problems = [f"{exc}"]
        if problems and publisher.index.chunk(record.chunk_id) is not None:
            bad.append(record.chunk_id)
            summary.quarantined_chunks.append(
                f"{record.namespace.hex()}/{record.chunk_id:016x}: {problems[0]}"
            )
            logger.warning("bad chunk %s", summary.quarantined_chunks[-1])
        tick("", 1)
    summary.quarantined = len(bad)
    if bad and not options.dry_run:
        publisher.quarantine(bad)


def _evict(
    publisher: Publisher, config: StoreConfig, options: Options, summary: Summary
) -> None:
    assert options.target is not None
    total, _, _ = publisher.index.totals()
    excess = excess_bytes(total, config.capacity, options.target)
    if excess <= 0:
        return
    if options.dry_run:
        plan = publisher.index.evict_plan(excess, config.evict_grace_s)
        summary.evicted = len(plan)
        return
    summary.evicted = len(publisher.evict(excess))


__all__ = ["MaintenanceBusy", "Options", "Summary", "open_cache", "run"]
