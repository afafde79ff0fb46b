"""Bad input at start-up: the directory (read-only, a file, foreign files, a
missing or bogus parent, tmpfs), its marker and namespace files, and garbled
configuration. The store raises one clear error naming what it found and what
it expected; the connector turns itself off with one error line (cache_dir,
the path, the reason) and vLLM serves on; never a raw traceback.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from npukv_store import (
    BadMagic,
    ConfigError,
    KVStore,
    NamespaceMismatch,
    StoreConfig,
    VersionMismatch,
)
from tests.support import faults
from tests.support.blocks import block_tensors
from tests.support.faults import BIG, SMALL, config, keys_for

# -- the connector's degraded mode ------------------------------------------------


def _connector_turns_off(fault, cfg: StoreConfig, caplog, *reasons: str) -> None:
    """Both connector roles start, turn off with one error line naming
    cache_dir, the path and ``reasons``, and answer vLLM's calls harmlessly."""
    pytest.importorskip("torch")
    pytest.importorskip("vllm", reason="the connector needs vLLM")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from npukv_store.connector.connector import NPUKVStoreConnector
    from tests.support.connector import cpu_caches, engine_config, make_request

    extra = {k: getattr(cfg, k) for k in ("cache_dir", "capacity", "ring_size")}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="npukv_store"):
        try:
            vllm_config, kv_cache_config = engine_config(extra=extra)
            scheduler = NPUKVStoreConnector(
                vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
            )
            worker = NPUKVStoreConnector(
                vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
            worker.register_kv_caches(cpu_caches(seed=0))
            request = make_request("r", list(range(100)))
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
            worker.start_load_kv(None)
            worker.wait_for_save()
            scheduler.shutdown()
            worker.shutdown()
        except Exception as exc:  # the connector raised into vLLM's start-up
            fault.crashed(f"the connector raised {exc!r} at start-up")
            return
    lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
    text = "\n".join(r.getMessage() for r in lines)
    if any(r.exc_info for r in caplog.records) or "Traceback" in caplog.text:
        fault.crashed(f"a traceback where one line was expected:\n{caplog.text}")
    assert len(lines) == 1, f"expected one error line, found:\n{caplog.text}"
    for needed in ("the connector is off", "cache_dir", os.path.abspath(cfg.cache_dir),
                   *reasons):  # fmt: skip
        assert needed in text, f"{needed!r} not in {text!r}"


def _put_some(cfg: StoreConfig, tag: str) -> list[bytes]:
    with KVStore(cfg, SMALL) as store:
        keys = keys_for(tag, 4)
        store.put(keys, block_tensors(SMALL, keys))
    return keys


# -- the directory ----------------------------------------------------------------


@pytest.mark.fault("cache-dir-read-only")
def test_read_only_cache_dir(fault, tmp_path, caplog):
    for trial in fault.trials(2, 4):
        root = tmp_path / f"ro{trial}"
        root.mkdir()
        cfg = config(root)
        populated = trial % 2 == 1
        if populated:
            _put_some(cfg, f"ro{trial}")
        with faults.read_only(root):
            with pytest.raises(OSError, match="Read-only file system") as caught:
                KVStore(cfg, SMALL)
            assert str(root) in str(caught.value)
            _connector_turns_off(fault, cfg, caplog, "Read-only file system")


@pytest.mark.fault("cache-dir-is-file")
def test_cache_dir_is_a_file(fault, tmp_path, caplog):
    for trial in fault.trials(1, 2):
        path = tmp_path / f"file{trial}"
        path.write_text("not a directory")
        cfg = config(path)
        with pytest.raises(ConfigError, match=f"cache_dir: {path} is a file"):
            KVStore(cfg, SMALL)
        _connector_turns_off(fault, cfg, caplog, "is a file, expected a directory")
        assert path.read_text() == "not a directory"


@pytest.mark.fault("cache-dir-missing-parent")
def test_missing_parents_are_created(fault, tmp_path):
    for trial in fault.trials(1, 2):
        cfg = config(tmp_path / f"a{trial}" / "b" / "c")
        keys = _put_some(cfg, f"parents{trial}")
        with KVStore(cfg, SMALL) as store:
            fault.durable(store, keys)


@pytest.mark.fault("cache-dir-parent-is-file")
def test_a_parent_that_is_a_file(fault, tmp_path, caplog):
    for trial in fault.trials(1, 2):
        parent = tmp_path / f"plain{trial}"
        parent.write_text("x")
        cfg = config(parent / "cache")
        with pytest.raises(NotADirectoryError) as caught:
            KVStore(cfg, SMALL)
        assert str(parent) in str(caught.value)
        _connector_turns_off(fault, cfg, caplog, "Not a directory")


@pytest.mark.fault("cache-dir-on-tmpfs")
def test_cache_dir_on_tmpfs_works(fault, tmp_path):
    with faults.tmpfs(tmp_path / "fs", "64m") as mount:
        for trial in fault.trials(1, 3):
            cfg = config(os.path.join(mount, f"c{trial}"), direct_io=True)
            with KVStore(cfg, BIG) as store:
                keys = keys_for(f"tmpfs{trial}", faults.BLOCKS)
                store.put_async(keys, block_tensors(BIG, keys))
                assert store.flush(timeout_s=60)
                sync_keys = keys_for(f"tmpfs-sync{trial}", faults.BLOCKS)
                store.put(sync_keys, block_tensors(BIG, sync_keys))
            with KVStore(cfg, BIG) as store:
                fault.durable(store, keys + sync_keys)
                assert store.check(verify_data=True) == []


@pytest.mark.fault("cache-dir-foreign-files")
def test_foreign_files_are_refused_and_kept(fault, tmp_path, caplog):
    for trial in fault.trials(1, 2):
        root = tmp_path / f"home{trial}"
        root.mkdir()
        (root / "thesis.tex").write_text("precious")
        (root / "tmp").mkdir()
        (root / "tmp" / "123-abc.tmp").write_text("also precious")
        cfg = config(root)
        with pytest.raises(ConfigError, match="no NPUKV_STORE marker"):
            KVStore(cfg, SMALL)
        _connector_turns_off(fault, cfg, caplog, "thesis.tex", "NPUKV_STORE")
        assert (root / "thesis.tex").read_text() == "precious"
        assert (root / "tmp" / "123-abc.tmp").read_text() == "also precious"


# -- the marker and namespace.json ------------------------------------------------


def _marker(root: str) -> str:
    return os.path.join(root, "NPUKV_STORE")


@pytest.mark.fault("marker-garbled")
def test_garbled_marker(fault, tmp_path, caplog):
    for trial in fault.trials(2, 4):
        cfg = config(tmp_path / f"m{trial}")
        _put_some(cfg, f"marker{trial}")
        body = [b"not json", b"\x00\xff" * 30, b'{"magic": "other"}', b"[]"][trial % 4]
        with open(_marker(cfg.cache_dir), "wb") as handle:
            handle.write(body)
        with pytest.raises(BadMagic) as caught:
            KVStore(cfg, SMALL)
        assert _marker(cfg.cache_dir) in str(caught.value)
        assert "npukv" in str(caught.value)
        _connector_turns_off(fault, cfg, caplog, "NPUKV_STORE")


@pytest.mark.fault("marker-other-version")
def test_marker_of_another_format_version(fault, tmp_path, caplog):
    for trial in fault.trials(1, 3):
        cfg = config(tmp_path / f"v{trial}")
        _put_some(cfg, f"version{trial}")
        with open(_marker(cfg.cache_dir)) as handle:
            body = json.load(handle)
        found = [99, 0, "1"][trial % 3]
        body["format_version"] = found
        with open(_marker(cfg.cache_dir), "w") as handle:
            json.dump(body, handle)
        with pytest.raises(VersionMismatch, match=f"format version {found!r}"):
            KVStore(cfg, SMALL)
        _connector_turns_off(fault, cfg, caplog, "format version")


@pytest.mark.fault("namespace-json-other-spec")
def test_namespace_json_of_another_spec(fault, tmp_path):
    for trial in fault.trials(1, 3):
        cfg = config(tmp_path / f"ns{trial}")
        keys = _put_some(cfg, f"ns{trial}")
        with KVStore(cfg, SMALL) as store:
            path = os.path.join(cfg.cache_dir, store.namespace, "namespace.json")
        with open(path) as handle:
            spec = json.load(handle)
        spec["block_size"] = 999 + trial
        with open(path, "w") as handle:
            json.dump(spec, handle)
        with pytest.raises(NamespaceMismatch) as caught:
            KVStore(cfg, SMALL)
        message = str(caught.value)
        assert path in message, message
        assert "expected" in message, message
        os.unlink(path)  # the operator removes the bogus file: all is back
        with KVStore(cfg, SMALL) as store:
            fault.durable(store, keys)


# -- configuration ----------------------------------------------------------------

#: key -> a garbled value and a fragment its error must contain
GARBLED = {
    "cache_dir": ("", "cache_dir: found ''"),
    "capacity": ("lots", "capacity: found 'lots'"),
    "tenant_shares": ('{"a": "60%", "b": 0.5}', "tenant_shares: found shares adding"),
    "admission": ("sometimes", "admission: found 'sometimes', expected one of auto"),
    "write_budget": ("-1dwpd", "write_budget: found '-1dwpd', expected drive writes"),
    "ring_size": ("-1GiB", "ring_size: found '-1GiB'"),
    "chunk_target_size": ("1.5XB", "chunk_target_size: found '1.5XB'"),
    "io_engine": ("fast", "io_engine: found 'fast'"),
    "io_queue_depth": ("0", "io_queue_depth: found 0"),
    "direct_io": ("maybe", "direct_io: found 'maybe'"),
    "fsync": ("sometimes", "fsync: found 'sometimes'"),
    "verify": ("rarely", "verify: found 'rarely'"),
    "layerwise": ("sideways", "layerwise: found 'sideways'"),
    "prefetch_depth": ("two", "prefetch_depth: found 'two'"),
    "save_decode": ("2", "save_decode: found '2'"),
    "load_without_prefix_caching": ("perhaps", "load_without_prefix_caching"),
    "load_policy": ("never", "load_policy: found 'never'"),
    "load_margin": ("-0.5", "load_margin: found -0.5"),
    "sliding_save": ("some", "sliding_save: found 'some'"),
    "kv_events_medium": ("NV ME!", "kv_events_medium: found 'NV ME!'"),
    "namespace_extra": (5, "namespace_extra: found 5"),
    "index_map_size": ("1KiB", "index_map_size: found 1024 bytes"),
    "evict_grace_s": ("-1", "evict_grace_s: found -1.0"),
    "tmp_max_age_s": ("inf", "tmp_max_age_s: found inf"),
    "cache_group": (5, "cache_group: found 5"),
    "lock_timeout_s": ("-1", "lock_timeout_s: found -1.0"),
    "remote_store": ("redis", "remote_store: found 'redis'"),
    "mooncake_master": ("master", "mooncake_master: found 'master'"),
    "mooncake_metadata": ("etcd", "mooncake_metadata: found 'etcd'"),
    "mooncake_protocol": ("ib", "mooncake_protocol: found 'ib'"),
    "mooncake_device": (7, "mooncake_device: found 7"),
    "mooncake_segment_size": ("-1", "mooncake_segment_size: found '-1'"),
    "mooncake_local_buffer": ("1KiB", "mooncake_local_buffer: found 1024 bytes"),
    "remote_timeout_ms": ("0", "remote_timeout_ms: found 0.0"),
    "remote_promote": ("often", "remote_promote: found 'often'"),
    "remote_secret_file": (7, "remote_secret_file: found 7"),
    "remote_insecure": ("sure", "remote_insecure: found 'sure'"),
}


def test_every_config_key_has_a_garbled_case():
    assert set(GARBLED) == set(StoreConfig.keys())


@pytest.mark.fault("config-garbled")
def test_garbled_config_is_one_clear_error(fault, tmp_path):
    keys = list(GARBLED)
    root = tmp_path / "never"
    for trial in fault.trials(len(keys) // 3, 2 * len(keys) + 1):
        if trial == 2 * len(keys):  # the unknown key
            with pytest.raises(ConfigError, match="unknown config key.*'capcity'"):
                StoreConfig.from_extra_config(
                    {"cache_dir": str(root), "capcity": "1GiB"}, env={}
                )
            continue
        key = keys[trial % len(keys)]
        value, fragment = GARBLED[key]
        extra: dict[str, object] = {"cache_dir": str(root)}
        env: dict[str, str] = {}
        if trial < len(keys) or key in (
            "namespace_extra",
            "mooncake_device",
            "cache_group",
            "remote_secret_file",
        ):  # (env: always a str)
            extra[key] = value
        else:  # the same value from the environment
            env[f"NPUKV_{key.upper()}"] = str(value)
        with pytest.raises(ConfigError) as caught:
            StoreConfig.from_extra_config(extra, env=env)
        message = str(caught.value)
        assert fragment in message, message
        assert "expected" in message, message
        assert "\n" not in message, message
        assert not root.exists(), "a bad config touched the disk"
    shutil.rmtree(root, ignore_errors=True)
