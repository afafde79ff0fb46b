"""The npukv operator CLI against a real directory: stats, inspect, verify
(finding and fixing damage) and rebuild-index."""

from __future__ import annotations

import json
import os
import shutil

from npukv_store import KVStore, StoreConfig
from npukv_store.cli import main
from tests.conftest import block_tensors, tiny_spec


def fill(root):
    with KVStore(StoreConfig(cache_dir=root), tiny_spec()) as store:
        keys = store.keys_for(range(64))
        store.put(keys, block_tensors(store.spec, keys))
        chunks = os.path.join(root, store.namespace, "chunks")
    return keys, os.path.join(chunks, os.listdir(chunks)[0])


def test_stats_inspect_verify_rebuild(tmp_path, capsys):
    root = str(tmp_path / "c")
    keys, chunk = fill(root)
    assert main(["stats", root]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_blocks"] == 4
    assert stats["num_chunks"] == 1
    assert main(["inspect", chunk]) == 0
    header = json.loads(capsys.readouterr().out)
    assert header["keys"][0] == keys[0].hex()
    assert main(["verify", root]) == 0
    assert "0 problem(s)" in capsys.readouterr().out

    with open(chunk, "r+b") as handle:  # damage one data byte
        handle.seek(4096 + 5)
        handle.write(b"\xaa\xbb")
    assert main(["verify", root]) == 1
    assert "checksum" in capsys.readouterr().out

    shutil.rmtree(os.path.join(root, "index"))
    assert main(["rebuild-index", root]) == 0
    assert "1 chunks, 4 blocks" in capsys.readouterr().out


def test_bad_directory_is_one_line_on_stderr(tmp_path, capsys):
    assert main(["stats", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no NPUKV_STORE marker" in err
    assert err.count("\n") == 1
