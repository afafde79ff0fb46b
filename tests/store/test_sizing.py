"""The maintenance job and the ``npukv`` commands open the index with the map
size the servers use (the largest LMDB recorded in the file), never less than
the default."""

from __future__ import annotations

import pytest

from npukv_store import KVStore, StoreConfig, maintenance
from npukv_store.cli import main as npukv
from npukv_store.store import recovery
from npukv_store.store.sizing import recorded_map_size
from tests.support.blocks import block_tensors, tiny_spec

GIB = 1 << 30
DEFAULT = StoreConfig(cache_dir="/unused").index_map_size


def _serve(root, map_size: int) -> None:
    """A server with ``index_map_size`` that commits one chunk, then exits."""
    config = StoreConfig(cache_dir=str(root), index_map_size=map_size)
    with KVStore(config, tiny_spec()) as store:
        keys = store.keys_for(range(64))
        assert store.put(keys, block_tensors(store.spec, keys)).stored


@pytest.mark.parametrize(
    ("served", "expected"),
    [(16 * GIB, 16 * GIB), (2 * GIB, DEFAULT), (DEFAULT, DEFAULT)],
)
def test_maintenance_opens_the_index_with_the_servers_map_size(
    tmp_path, monkeypatch, served, expected
):
    root = tmp_path / "cache"
    _serve(root, served)
    assert recorded_map_size(maintenance.open_cache(str(root)), DEFAULT) == expected
    seen = []

    def spy(cdir, *, map_size, sync):
        seen.append(map_size)
        raise _Opened  # what the run does next is not this test's

    monkeypatch.setattr(recovery, "open_index", spy)
    with pytest.raises(_Opened):
        maintenance.run(maintenance.Options(cache_dir=str(root), compact=False))
    assert seen == [expected]


class _Opened(Exception):
    pass


@pytest.mark.parametrize("command", ["stats", "verify", "rebuild-index"])
def test_the_cli_opens_the_index_with_the_servers_map_size(
    tmp_path, monkeypatch, command
):
    root = tmp_path / "cache"
    _serve(root, 16 * GIB)
    seen = []

    def spy(cdir, *, map_size, sync):
        seen.append(map_size)
        raise _Opened

    monkeypatch.setattr(recovery, "open_index", spy)
    monkeypatch.setattr(recovery, "rebuild_index", spy)
    with pytest.raises(_Opened):
        npukv([command, str(root)])
    assert seen == [16 * GIB]


def test_no_index_yet_is_the_default(tmp_path):
    root = tmp_path / "cache"
    with KVStore(StoreConfig(cache_dir=str(root)), tiny_spec()):
        pass
    cdir = maintenance.open_cache(str(root))
    (root / "index" / "data.mdb").unlink()
    assert recorded_map_size(cdir, DEFAULT) == DEFAULT
    assert not (root / "index" / "data.mdb").exists()  # nothing created
