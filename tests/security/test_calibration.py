"""A calibration file planted in a cache directory (store/calibration.py).

The file only picks the route of a chunk's first read, and a reader loads it
with ``CacheDir.read_bytes``: never through a symlink, never another user's
file, never a world-writable one, at most 64 KiB. Whatever it holds, loading
it never raises (a bad file is no calibration: the constants apply) and a
store that follows it reads exactly the bytes stored: every route ends in the
same checksum comparison, so a forged speed can slow reads, never make them
wrong.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npukv_store import KVStore, StoreConfig
from npukv_store.store import calibration
from npukv_store.store.directory import CacheDir
from tests.support.blocks import block_tensors
from tests.support.chunks import (
    BLOCKS,
    aligned_out,
    aligned_spec,
    evict_from_page_cache,
)

GOOD = {
    "format": calibration.FORMAT,
    "version": calibration.VERSION,
    "measured_ns": 1,
    "sample_bytes": 1 << 20,
    "gbps": {kind: 1.0 for kind in calibration._KINDS},
}


@pytest.fixture
def stored(tmp_path):
    spec = aligned_spec()
    config = StoreConfig(cache_dir=str(tmp_path / "cache"), capacity="64MiB")
    keys = [bytes([i, 9]) * 8 for i in range(BLOCKS)]
    with KVStore(config, spec) as store:
        assert store.put(keys, block_tensors(spec, keys)).stored == BLOCKS
        device = calibration.device_id(store.dir)
    return config, spec, keys, device


def reads_right(config, spec, keys) -> None:
    """A cold read of every key: all hits, every byte as stored."""
    evict_from_page_cache(config.cache_dir)
    out = aligned_out(spec, BLOCKS)
    with KVStore(config, spec) as store:
        assert store.read(keys, out) == [True] * BLOCKS
    for name, array in block_tensors(spec, keys).items():
        np.testing.assert_array_equal(out[name], array)


def plant(config, data: bytes, mode: int = 0o600) -> str:
    path = os.path.join(config.cache_dir, calibration.FILE_NAME)
    with open(path, "wb") as handle:
        handle.write(data)
    os.chmod(path, mode)
    return path


def loaded(config):
    cdir = CacheDir(config.cache_dir)
    cdir.open()
    try:
        return calibration.load(cdir)
    finally:
        cdir.close()


def body(device: object, **changes: object) -> bytes:
    return json.dumps({**GOOD, "device": device, **changes}).encode()


def test_a_planted_good_file_is_loaded(stored):
    """The baseline the attacks below differ from by one thing each."""
    config, _, _, device = stored
    plant(config, body(device))
    assert loaded(config) is not None


@pytest.mark.parametrize(
    "kind",
    [
        "not JSON", "JSON bomb: 100k nested lists", "65 KiB of spaces", "a list",
        "NaN speed", "infinite speed", "negative speed", "speed as a string",
        "speed as true", "speed 1e300", "zero buffered speed", "gbps missing",
        "gbps a list", "device a number", "foreign format", "version 2",
        "measured_ns negative", "invalid UTF-8",
    ],
)  # fmt: skip
def test_a_malformed_file_is_ignored_and_reads_stay_right(attack, stored, caplog, kind):
    config, spec, keys, device = stored
    gbps = dict(GOOD["gbps"])
    data = {
        "not JSON": b"{not json",
        "JSON bomb: 100k nested lists": b"[" * 100_000 + b"]" * 100_000,
        "65 KiB of spaces": body(device) + b" " * (65 << 10),
        "a list": b"[1, 2]",
        "NaN speed": body(device, gbps={**gbps, "direct_qd16": float("nan")}),
        "infinite speed": body(device, gbps={**gbps, "buffered_qd1": float("inf")}),
        "negative speed": body(device, gbps={**gbps, "direct_qd1": -5.0}),
        "speed as a string": body(device, gbps={**gbps, "direct_qd1": "fast"}),
        "speed as true": body(device, gbps={**gbps, "buffered_qd16": True}),
        "speed 1e300": body(device, gbps={**gbps, "buffered_qd16": 1e300}),
        "zero buffered speed": body(device, gbps={**gbps, "buffered_qd1": 0.0}),
        "gbps missing": body(device, gbps={"direct_qd1": 1.0}),
        "gbps a list": body(device, gbps=[1, 2, 3, 4]),
        "device a number": body(7),
        "foreign format": body(device, format="something else"),
        "version 2": body(device, version=2),
        "measured_ns negative": body(device, measured_ns=-1),
        "invalid UTF-8": b"\xff\xfe" + body(device),
    }[kind]
    with attack(f"calibration: {kind}"):
        plant(config, data)
        assert loaded(config) is None
        assert "ignored" in caplog.text
        reads_right(config, spec, keys)


def test_a_symlinked_file_is_not_followed(attack, stored, tmp_path):
    config, spec, keys, device = stored
    target = tmp_path / "elsewhere.json"
    target.write_bytes(body(device, gbps={k: 99.0 for k in calibration._KINDS}))
    with attack("calibration: symlink -> outside"):
        os.symlink(target, os.path.join(config.cache_dir, calibration.FILE_NAME))
        assert loaded(config) is None
        reads_right(config, spec, keys)
        assert json.loads(target.read_bytes())["gbps"]["direct_qd1"] == 99.0


def test_a_world_writable_file_is_ignored(attack, stored):
    config, spec, keys, device = stored
    with attack("calibration: world-writable file"):
        plant(config, body(device), mode=0o666)
        assert loaded(config) is None
        reads_right(config, spec, keys)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_user_s_file_is_ignored(attack, stored):
    config, spec, keys, device = stored
    with attack("calibration: another user's file"):
        path = plant(config, body(device))
        os.chown(path, 65534, 65534)
        assert loaded(config) is None
        reads_right(config, spec, keys)


@pytest.mark.parametrize("fast", ["buffered", "direct"])
def test_a_forged_extreme_calibration_changes_the_route_not_the_bytes(
    attack, stored, fast
):
    config, spec, keys, device = stored
    speeds = {k: (1e4 if k.startswith(fast) else 1e-4) for k in calibration._KINDS}
    with attack(f"calibration: forged, {fast} 10^8 times faster"):
        plant(config, body(device, gbps=speeds))
        found = loaded(config)
        assert found is not None
        assert found.direct_first_reads is (fast == "direct")
        reads_right(config, spec, keys)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # one trial each
)
@given(data=st.binary(max_size=2048) | st.text(max_size=512).map(str.encode))
def test_loading_any_bytes_never_raises(attack, tmp_path_factory, data):
    root = str(tmp_path_factory.mktemp("fuzz") / "cache")
    cdir = CacheDir(root)
    cdir.open()
    try:
        with attack("calibration: fuzzed bytes"):
            with open(os.path.join(root, calibration.FILE_NAME), "wb") as handle:
                handle.write(data)
            found = calibration.load(cdir)
            assert found is None or found.direct_first_reads in (True, False)
    finally:
        cdir.close()
