"""The disk under a cache directory, measured once: which read route it prefers.

Runs in: ``npukv calibrate`` and the maintenance job (``ensure``: measure);
every reading process (``load``: a small JSON file read once per handle).

    Calibration     - four cold read speeds of one device, and where they were taken
    measure()       - time them on a scratch file in tmp/ (a few hundred ms)
    save() / load() - ``calibration.json`` in the cache directory: written
                      atomically with the directory's file mode; a file that is
                      missing, foreign, malformed, out of range or of another
                      device loads as None (the constants then apply)
    ensure()        - load, or measure and save where there is none for this device
    derived_tuning() - the ReadTuning fields the measurement sets

The store's first read of a chunk went O_DIRECT on every disk: right where
O_DIRECT is the faster cold read (the "vm" disk: 1.9 against 1.3-1.6 GB/s at
queue depth 16), 0.69 of the disk where buffered reads are faster (1.96
against 1.30 GB/s on another VM). The calibration measures both and lets the
first read follow the faster one (docs/decisions/0063). Only the route
changes: every route ends in the same checksum comparison, so a calibration
that is wrong, forged or stale can make reads slower, never wrong.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from npukv_store.io.direct import aligned_buffer, open_direct
from npukv_store.io.engine import READ, IORequest, make_engine
from npukv_store.store.directory import CacheDir

logger = logging.getLogger(__name__)

FILE_NAME = "calibration.json"
LOCK_NAME = "calibration.lock"
FORMAT = "npukv-calibration"
VERSION = 1
#: First reads are buffered only where buffered cold reads beat O_DIRECT ones
#: by this much: the measurement is short and noisy (on the vm disk three runs
#: disagreed), the store's buffered routes reach less of the raw buffered
#: speed than its direct route of the raw direct one (vm: 0.49-0.66 against
#: about 0.85, docs/benchmarks/bench_ab_issue16.json), and on a tie O_DIRECT
#: keeps KV read once out of the page cache (docs/decisions/0012). The disk
#: that asked for this read 1.51x faster buffered (issue 27).
BUFFERED_MARGIN = 1.25
#: A speed outside this range is no measurement of a disk (GB/s).
MIN_GBPS, MAX_GBPS = 1e-4, 1e4
_MAX_FILE_BYTES = 64 << 10
_REQUEST_BYTES = 1 << 20
_KINDS = ("buffered_qd1", "buffered_qd16", "direct_qd1", "direct_qd16")


@dataclass(frozen=True)
class Calibration:
    """Cold read speeds (GB/s) of the device of a cache directory."""

    device: str  # device_id() where it was measured
    measured_ns: int
    sample_bytes: int
    buffered_qd1: float
    buffered_qd16: float
    direct_qd1: float  # 0.0 where the filesystem refuses O_DIRECT
    direct_qd16: float

    @property
    def direct_first_reads(self) -> bool:
        """Whether a chunk's first read goes O_DIRECT on this disk."""
        direct = max(self.direct_qd1, self.direct_qd16)
        buffered = max(self.buffered_qd1, self.buffered_qd16)
        return direct > 0 and buffered <= BUFFERED_MARGIN * direct

    def summary(self) -> dict[str, Any]:
        """What ``npukv stats`` shows: the speeds and the route they chose."""
        return {
            **asdict(self),
            "first_reads": "direct" if self.direct_first_reads else "buffered",
        }


def derived_tuning(calibration: Calibration | None) -> dict[str, Any]:
    """The ReadTuning fields a calibration sets; without one, the constants'
    choice (O_DIRECT first reads, ReadTuning's stream threshold).

    ``direct_first_reads``: see :attr:`Calibration.direct_first_reads`.
    ``stream_above_bytes`` 0 where first reads go buffered and one buffered
    request at a time reads at least as fast as 16: such a disk gains
    nothing from parallel requests, and one stream per layer with the
    kernel's readahead beats 1 MiB engine requests. Measured on a disk of
    that kind (bench store, the same run: buffered QD1 3.66 against QD16
    3.01 GB/s): a cold one-call read of 1 GiB streamed at 3.75 GB/s against
    2.82 through the engine.
    """
    if calibration is None:
        return {"direct_first_reads": True}
    derived: dict[str, Any] = {"direct_first_reads": calibration.direct_first_reads}
    streams = calibration.buffered_qd1 >= calibration.buffered_qd16
    if not calibration.direct_first_reads and streams:
        derived["stream_above_bytes"] = 0
    return derived


def device_id(cdir: CacheDir) -> str:
    """The device of the directory's root: ``major:minor``, and the block
    device's size where sysfs tells it (a disk swapped in under the same
    numbers is most often another size)."""
    dev = os.fstat(cdir.fd).st_dev
    name = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open(f"/sys/dev/block/{name}/size", encoding="ascii") as handle:
            return f"{name}/{int(handle.read().strip())}"
    except (OSError, ValueError):
        return name


# -- the file -----------------------------------------------------------------


def load(cdir: CacheDir) -> Calibration | None:
    """The directory's calibration for its current device; None (constants)
    where there is none, or where the file is not one this code wrote for this
    device: a symlink, someone else's, world-writable, too large, not JSON,
    with fields missing, of the wrong type or out of range. Never raises."""
    try:
        raw = cdir.read_bytes(FILE_NAME, limit=_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # UnsafeEntry is an OSError too
        logger.warning("%s ignored (read routes from constants): %s", FILE_NAME, exc)
        return None
    try:
        found = _parse(raw)
        current = device_id(cdir)
    except Exception as exc:  # noqa: BLE001 - any malformed file is no calibration
        logger.warning("%s ignored (read routes from constants): %s", FILE_NAME, exc)
        return None
    if found.device != current:
        logger.info(
            "%s is of device %s, the cache is on %s now: not used (npukv calibrate)",
            FILE_NAME, found.device, current,
        )  # fmt: skip
        return None
    return found


def _parse(raw: bytes) -> Calibration:
    if len(raw) > _MAX_FILE_BYTES:
        raise ValueError(f"larger than {_MAX_FILE_BYTES} bytes")
    body = json.loads(raw.decode("utf-8"))
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise ValueError(
            f"format {body.get('format')!r} version {body.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}"
        )
    device, measured, sample = body["device"], body["measured_ns"], body["sample_bytes"]
    if not isinstance(device, str) or len(device) > 256:
        raise ValueError(f"device: found {device!r}, expected a device id")
    for name, number in (("measured_ns", measured), ("sample_bytes", sample)):
        if type(number) is not int or number <= 0:
            raise ValueError(f"{name}: found {number!r}, expected an integer > 0")
    speeds = {kind: body["gbps"][kind] for kind in _KINDS}
    for kind, speed in speeds.items():
        if type(speed) not in (int, float) or not math.isfinite(speed):
            raise ValueError(f"gbps.{kind}: found {speed!r}, expected a number")
        low = 0.0 if kind.startswith("direct") else MIN_GBPS
        if not (speed == 0.0 == low or MIN_GBPS <= speed <= MAX_GBPS):
            raise ValueError(f"gbps.{kind}: {speed} is outside {low}-{MAX_GBPS}")
    floats = {kind: float(speed) for kind, speed in speeds.items()}
    return Calibration(device, measured, sample, **floats)


def save(cdir: CacheDir, calibration: Calibration) -> None:
    """Write ``calibration.json`` atomically: a tmp/ file with the cache's
    file mode, fsynced, renamed over the old one."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "device": calibration.device,
        "measured_ns": calibration.measured_ns,
        "sample_bytes": calibration.sample_bytes,
        "gbps": {kind: getattr(calibration, kind) for kind in _KINDS},
    }
    tmp = cdir.tmp_path("calibration")
    fd = cdir.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            os.write(fd, json.dumps(body, indent=1).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        cdir.rename(tmp, FILE_NAME)
    finally:
        cdir.unlink_quietly(tmp)


def ensure(cdir: CacheDir, sample_bytes: int = 64 << 20) -> Calibration | None:
    """The directory's calibration: loaded, or measured and saved where there
    is none for this device. One process measures at a time; another that
    finds it measuring returns None rather than wait (constants meanwhile)."""
    found = load(cdir)
    if found is not None:
        return found
    with _measuring(cdir) as ours:
        if not ours:
            return None
        found = load(cdir)  # another process may have finished meanwhile
        if found is None:
            found = measure(cdir, sample_bytes)
            save(cdir, found)
    return found


@contextlib.contextmanager
def _measuring(cdir: CacheDir) -> Iterator[bool]:
    fd = cdir.open_file(LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)


# -- the measurement ------------------------------------------------------------


def measure(cdir: CacheDir, sample_bytes: int = 64 << 20) -> Calibration:
    """Time cold reads of a ``sample_bytes`` scratch file in the cache's tmp/,
    in 1 MiB requests at queue depth 1 and 16, buffered and O_DIRECT: each
    kind twice, interleaved, the faster kept. The file is removed after."""
    sample_bytes = max(_REQUEST_BYTES, sample_bytes // _REQUEST_BYTES * _REQUEST_BYTES)
    tmp = cdir.tmp_path("calibrate")
    fd = cdir.open_file(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        payload = secrets.token_bytes(_REQUEST_BYTES)
        for offset in range(0, sample_bytes, _REQUEST_BYTES):
            os.pwrite(fd, payload, offset)
        os.fsync(fd)
        direct_fd, direct = open_direct(f"/proc/self/fd/{fd}", os.O_RDONLY)
        try:
            best = dict.fromkeys(_KINDS, 0.0)
            for kind in (*_KINDS, *reversed(_KINDS)):
                if kind.startswith("direct") and not direct:
                    continue  # the filesystem refuses O_DIRECT: never a route
                depth = 16 if kind.endswith("qd16") else 1
                use = direct_fd if kind.startswith("direct") else fd
                seconds = _cold_read(fd, use, sample_bytes, depth)
                best[kind] = max(best[kind], sample_bytes / seconds / 1e9)
        finally:
            os.close(direct_fd)
    finally:
        os.close(fd)
        cdir.unlink_quietly(tmp)
    return Calibration(device_id(cdir), time.time_ns(), sample_bytes, **best)


def _cold_read(fd: int, read_fd: int, nbytes: int, depth: int) -> float:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean (fsynced) pages
    buffers = [aligned_buffer(_REQUEST_BYTES) for _ in range(depth)]
    requests = [
        IORequest(READ, read_fd, offset, buffers[i % depth].data, i)
        for i, offset in enumerate(range(0, nbytes, _REQUEST_BYTES))
    ]
    with make_engine("auto", depth) as engine:
        began = time.perf_counter()
        for done in engine.stream(requests):
            if done.result != _REQUEST_BYTES:
                raise OSError(-done.result if done.result < 0 else errno.EIO, "read")
        return max(time.perf_counter() - began, 1e-9)


def as_stats(cdir: CacheDir) -> Mapping[str, Any] | None:
    """The calibration ``npukv stats`` reports, or None (constants)."""
    found = load(cdir)
    return None if found is None else found.summary()
