"""The disk's calibration (store/calibration.py): measured into the cache
directory, loaded by readers for their device only, and followed by the first
read of a chunk: O_DIRECT where the disk reads faster around the cache,
buffered where it reads faster through it. Either way the bytes read are the
bytes stored (routes change speed only)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import stat

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npukv_store import KVStore, StoreConfig, maintenance
from npukv_store.cli import main as npukv
from npukv_store.cli import render, reports
from npukv_store.store import calibration
from npukv_store.store.calibration import Calibration
from npukv_store.store.directory import CacheDir
from npukv_store.store.read.plan import ReadTuning
from tests.support.blocks import block_tensors
from tests.support.chunks import (
    BLOCKS,
    aligned_out,
    aligned_spec,
    evict_from_page_cache,
)

SAMPLE = 2 << 20


def opened(root: str) -> CacheDir:
    cdir = CacheDir(root)
    cdir.open()
    return cdir


def calibrated(cdir: CacheDir, buffered: float, direct: float) -> Calibration:
    return Calibration(
        calibration.device_id(cdir), 1, SAMPLE, buffered, buffered, direct, direct
    )


def test_a_measurement_is_saved_with_the_cache_s_mode_and_loaded(tmp_path):
    cdir = opened(str(tmp_path / "cache"))
    found = calibration.measure(cdir, SAMPLE)
    speeds = [found.buffered_qd1, found.buffered_qd16, found.direct_qd16]
    assert all(speed > 0 for speed in speeds), found
    calibration.save(cdir, found)
    assert calibration.load(cdir) == found
    mode = os.stat(cdir.full(calibration.FILE_NAME)).st_mode
    assert stat.S_IMODE(mode) == cdir.access.file_mode
    assert os.listdir(cdir.tmp_dir) == []  # the scratch and staging files are gone


def test_a_calibration_of_another_device_is_not_used(tmp_path):
    cdir = opened(str(tmp_path / "cache"))
    found = calibrated(cdir, 9.0, 1.0)
    calibration.save(cdir, Calibration(**{**found.__dict__, "device": "8:99/1"}))
    assert calibration.load(cdir) is None
    calibration.save(cdir, found)  # redone on this device: replaces the old one
    assert calibration.load(cdir) == found


def test_ensure_measures_once_and_not_while_another_process_measures(tmp_path):
    cdir = opened(str(tmp_path / "cache"))
    fd = cdir.open_file(calibration.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process measuring
    try:
        assert calibration.ensure(cdir, SAMPLE) is None
        assert calibration.load(cdir) is None
    finally:
        os.close(fd)
    first = calibration.ensure(cdir, SAMPLE)
    assert first is not None
    assert calibration.ensure(cdir, SAMPLE) == first  # loaded, not measured again


def test_maintenance_measures_once_per_device(tmp_path, monkeypatch):
    """The maintenance job calibrates a disk that has no calibration, keeps
    one of this device, and measures again once the cache is on another."""
    monkeypatch.setattr(maintenance, "CALIBRATION_SAMPLE", SAMPLE)
    root = str(tmp_path / "cache")
    with KVStore(StoreConfig(cache_dir=root), aligned_spec()):
        pass
    options = maintenance.Options(cache_dir=root, ring_dir=str(tmp_path))
    assert maintenance.run(options).calibration == "measured"
    cdir = opened(root)
    first = calibration.load(cdir)
    assert first is not None
    assert first.sample_bytes == SAMPLE
    assert maintenance.run(options).calibration == "kept"
    assert calibration.load(cdir) == first
    moved = Calibration(**{**first.__dict__, "device": "8:99/1"})
    calibration.save(cdir, moved)  # as if the directory moved to another disk
    assert maintenance.run(options).calibration == "measured"
    again = calibration.load(cdir)
    assert again is not None
    assert again.measured_ns > first.measured_ns
    gc_only = maintenance.Options(cache_dir=root, ring_dir=str(tmp_path), gc_only=True)
    assert maintenance.run(gc_only).calibration == ""  # gc never measures


@given(
    buffered=st.floats(0.001, 1000.0),
    direct=st.one_of(st.just(0.0), st.floats(0.001, 1000.0)),
)
def test_first_reads_go_direct_unless_buffered_reads_are_clearly_faster(
    buffered, direct
):
    found = Calibration("1:2", 1, SAMPLE, buffered, buffered / 2, direct / 3, direct)
    expected = direct > 0 and buffered <= calibration.BUFFERED_MARGIN * direct
    assert found.direct_first_reads is expected
    derived = calibration.derived_tuning(found)
    assert derived["direct_first_reads"] is expected
    # buffered QD1 (``buffered``) beats QD16 (half of it): where first reads
    # go buffered, each uncached layer is one stream
    assert derived.get("stream_above_bytes") == (None if expected else 0)
    assert found.summary()["first_reads"] == ("direct" if expected else "buffered")
    round_trip = calibration._parse(
        json.dumps(
            {
                "format": calibration.FORMAT, "version": calibration.VERSION,
                "device": "1:2", "measured_ns": 1, "sample_bytes": SAMPLE,
                "gbps": {k: getattr(found, k) for k in calibration._KINDS},
            }
        ).encode()
    )  # fmt: skip
    assert round_trip == found


@pytest.mark.parametrize(
    ("qd1", "qd16", "streamed"), [(3.66, 3.01, True), (2.0, 3.0, False)]
)
def test_buffered_first_reads_stream_where_one_request_is_as_fast(qd1, qd16, streamed):
    found = Calibration("1:2", 1, SAMPLE, qd1, qd16, 1.0, 1.0)
    assert not found.direct_first_reads
    derived = calibration.derived_tuning(found)
    assert ("stream_above_bytes" in derived) is streamed
    tuning = dataclasses.replace(ReadTuning(), **derived)
    assert (tuning.stream_above_bytes == 0) is streamed


def test_no_calibration_keeps_the_constants_route():
    assert calibration.derived_tuning(None) == {"direct_first_reads": True}
    assert ReadTuning().direct_first_reads is None  # follows the calibration


@pytest.mark.parametrize(
    ("buffered", "direct", "direct_reads"), [(1.0, 2.0, True), (2.0, 1.0, False)]
)
def test_the_first_read_follows_the_calibration_and_reads_the_same_bytes(
    tmp_path, buffered, direct, direct_reads
):
    spec = aligned_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "cache"), capacity="64MiB")
    keys = [bytes([i, 3]) * 8 for i in range(BLOCKS)]
    with KVStore(config, spec) as store:
        assert store.put(keys, block_tensors(spec, keys)).stored == BLOCKS
        calibration.save(store.dir, calibrated(store.dir, buffered, direct))
    evict_from_page_cache(config.cache_dir)
    out = aligned_out(spec, BLOCKS)
    with KVStore(config, spec) as store:
        assert store.read(keys, out) == [True] * BLOCKS
        moved = store.stats().counters["direct_read_bytes"]
    assert moved == (BLOCKS * spec.block_bytes if direct_reads else 0)
    for name, array in block_tensors(spec, keys).items():
        np.testing.assert_array_equal(out[name], array)


def test_stats_and_calibrate_report_the_route(tmp_path, capsys):
    root = str(tmp_path / "cache")
    cdir = opened(root)
    assert calibration.as_stats(cdir) is None
    assert "constants" in render.calibration_text(None)
    assert npukv(["calibrate", root, "--sample-mib", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["read_calibration"]
    assert printed == calibration.as_stats(cdir)
    text = render.calibration_text(printed)
    assert text.startswith(printed["first_reads"])
    assert f"{printed['direct_qd16']:.2f} GB/s" in text
    spec = aligned_spec()
    with KVStore(StoreConfig(cache_dir=root, capacity="64MiB"), spec) as store:
        report = reports.stats_report(store.dir, store.index, None)
    assert report["read_calibration"] == printed
    (totals, _) = render.stats_sections(report)
    assert ("first reads", text) in totals.rows
