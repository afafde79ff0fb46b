"""Bad input is a miss: numbers in chunk headers and claim records are
untrusted (security review, finding 7). Each attack below once raised out of
``KVStore()``, ``read()``, ``put()`` or gc, or blocked a block's saves for
good; now it is a miss, a skip or a removal, counted, and the store works.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import time

import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.cli.compact import main as maintenance_main
from npukv_store.store.claims import ClaimTable
from npukv_store.store.directory import HOST, CacheDir
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec
from tests.support.chunks import only_chunk

HUGE = "9" * 5000  # above int()'s 4300-digit limit
ORPHAN_ID = "00000000deadbeef"


def _rewrite_header(config: StoreConfig, edit, name: str | None = None) -> str:
    """The one chunk's bytes with ``edit`` applied to its header, written over
    it, or beside it as ``name`` (an orphan); the path written."""
    with KVStore(config, tiny_spec()) as store:
        path = only_chunk(config.cache_dir, store.namespace)
    with open(path, "rb") as handle:
        data = handle.read()
    target = path if name is None else os.path.join(os.path.dirname(path), name)
    with open(target, "wb") as handle:
        handle.write(_reheader(data, edit))
    return target


@pytest.fixture
def filled(tmp_path):
    """A directory holding one published chunk of 4 blocks: (config, keys)."""
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    with KVStore(config, tiny_spec()) as store:
        keys = store.keys_for(range(64))
        assert store.put(keys, block_tensors(store.spec, keys)).stored == 4
    return config, keys


def _reheader(data: bytes, edit) -> bytes:
    """``data`` (a chunk file) with its header JSON text replaced by
    ``edit(text)``, padded to a 4096 multiple; data offsets are relative to
    the data section, so they still hold."""
    (length,) = struct.unpack_from("<Q", data)
    text = edit(data[8 : 8 + length].rstrip(b" ").decode()).encode()
    total = -(-(8 + len(text)) // 4096) * 4096
    return struct.pack("<Q", total - 8) + text.ljust(total - 8) + data[8 + length :]


def _set_json(path: tuple[str, ...], value: object, raw: str | None = None):
    """An edit setting ``body[path...] = value``; ``raw`` replaces the value's
    JSON text (for numbers json.dumps cannot write, such as 5000 digits)."""

    def edit(text: str) -> str:
        body = json.loads(text)
        node = body
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = "@@RAW@@" if raw is not None else value
        out = json.dumps(body, separators=(",", ":"))
        return out.replace('"@@RAW@@"', raw) if raw is not None else out

    return edit


K0 = "model.layers.0.attn.k"


def _read_is_a_miss(config: StoreConfig, keys: list[bytes]) -> None:
    with KVStore(config, tiny_spec()) as store:
        out = empty_blocks(store.spec, len(keys))
        before = store.stats().counters["read_errors"]
        assert store.read(keys, out) == [False] * len(keys)
        assert store.stats().counters["read_errors"] > before, (
            "the miss was not counted"
        )
        assert store.lookup(keys) == 0  # quarantined: saved again, not missed forever
        store.put(keys, block_tensors(store.spec, keys))
        assert store.read(keys, out) == [True] * len(keys)


# -- a published chunk: read() is a miss --------------------------------------

PUBLISHED = {
    "5000-digit shape": _set_json((K0, "shape"), None, raw=f"[{HUGE},2]"),
    "5000-digit data offset": _set_json((K0, "data_offsets"), None, raw=f"[0,{HUGE}]"),
    "negative data offset": _set_json((K0, "data_offsets"), [-4096, 4096]),
    "data offsets past EOF": _set_json((K0, "data_offsets"), [0, 2**62]),
    "shape of 2**70 rows": _set_json((K0, "shape"), [2**70, 16, 2, 8]),
    "shape of 64 dims": _set_json((K0, "shape"), [1] * 64),
    "float shape": _set_json((K0, "shape"), [4.0, 16, 2, 8]),
    "list dtype": _set_json((K0, "dtype"), ["F16"]),
    "dict dtype": _set_json((K0, "dtype"), {"F16": 2}),
    "5000-digit created_ns": _set_json(("__metadata__", "npukv_created_ns"), HUGE),
    "huge key count": _set_json(("__metadata__", "npukv_keys"), "00" * 16 * 65537),
    "5000 layers": _set_json(
        ("__metadata__", "npukv_layers"), json.dumps([f"l{i}" for i in range(5000)])
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_chunk_with_bad_numbers_is_a_miss(attack, filled, name):
    config, keys = filled
    _rewrite_header(config, PUBLISHED[name])
    with attack(f"header: {name} in a published chunk"):
        _read_is_a_miss(config, keys)


def test_a_header_length_past_eof_is_a_miss(attack, filled):
    config, keys = filled
    with KVStore(config, tiny_spec()) as store:
        path = only_chunk(config.cache_dir, store.namespace)
    with open(path, "r+b") as handle:
        handle.write(struct.pack("<Q", 2**63 + 5))
    with attack("header: length 2**63 in a published chunk"):
        _read_is_a_miss(config, keys)


def test_a_5000_digit_created_ns_does_not_stop_an_index_rebuild(attack, filled):
    """The index is rebuilt from the chunks' own metadata, which int()'s
    created_ns; the chunk is dropped, the store opens."""
    config, keys = filled
    _rewrite_header(config, PUBLISHED["5000-digit created_ns"])
    shutil.rmtree(CacheDir(config.cache_dir).index_path)
    with (
        attack("header: 5000-digit created_ns at an index rebuild"),
        KVStore(config, tiny_spec()) as store,
    ):
        assert store.lookup(keys) == 0
        store.put(keys, block_tensors(store.spec, keys))
        assert store.read(keys, empty_blocks(store.spec, 4)) == [True] * 4


# -- an orphan chunk (no index record): gc removes it, the store still opens ---

ORPHANS = {
    "5000-digit shape": PUBLISHED["5000-digit shape"],
    "list dtype": PUBLISHED["list dtype"],
    "creator pid 2**31": _set_json(
        ("__metadata__", "npukv_creator"), f"{2**31}@{HOST}"
    ),
    "creator pid 2**64": _set_json(
        ("__metadata__", "npukv_creator"), f"{2**64}@{HOST}"
    ),
    "creator of 5000 digits": _set_json(
        ("__metadata__", "npukv_creator"), f"{HUGE}@{HOST}"
    ),
}


@pytest.mark.parametrize("name", sorted(ORPHANS))
def test_an_orphan_chunk_with_bad_numbers_does_not_stop_the_store(
    attack, filled, name, tmp_path
):
    config, keys = filled
    orphan = _rewrite_header(config, ORPHANS[name], f"{ORPHAN_ID}.safetensors")
    with attack(f"header: {name} in an orphan chunk"):
        # orphans are scanned by gc (and by an open after a dead session;
        # docs/decisions/0059), so gc meets the bad header first
        rings = tmp_path / "rings"
        rings.mkdir()
        argv = [config.cache_dir, "--gc-only", "--ring-dir", str(rings)]
        assert maintenance_main(argv) == 1  # 1: it found a problem, the orphan
        assert not os.path.exists(orphan), "a dead writer's orphan stayed"
        with KVStore(config, tiny_spec()) as store:
            assert store.read(keys, empty_blocks(store.spec, 4)) == [True] * 4


# -- claim records -------------------------------------------------------------


def _forge_claims(config: StoreConfig, keys: list[bytes], pid: int, deadline: int):
    table = ClaimTable(CacheDir(config.cache_dir).claims_path)
    try:
        with table._env.begin(write=True) as txn:
            for key in keys:
                txn.put(key, struct.pack("<IQ", pid, deadline))
        assert table.held() == len(keys)
    finally:
        table.close()


@pytest.mark.parametrize(
    ("name", "pid", "deadline_s"),
    [
        ("claim (pid 1, deadline 2**64-1)", 1, None),
        ("claim of pid 2**31", 2**31, 60),
        ("claim of pid 2**32-1", 2**32 - 1, 60),
        ("claim of pid 0", 0, 60),
    ],
)
def test_a_forged_claim_blocks_no_save(attack, tmp_path, name, pid, deadline_s):
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    spec = tiny_spec()
    with KVStore(config, spec):
        pass  # creates the directory
    with KVStore(config, spec) as probe:
        keys = probe.keys_for(range(64))
    deadline = 2**64 - 1 if deadline_s is None else time.time_ns() + deadline_s * 10**9
    _forge_claims(config, keys, pid, deadline)
    with attack(name):
        with KVStore(config, spec) as store:
            result = store.put(keys, block_tensors(spec, keys))
            assert (result.stored, result.skipped) == (4, 0), "the claim blocked saves"
            assert store.lookup(keys) == 4
        _forge_claims(config, keys, pid, deadline)
        table = ClaimTable(CacheDir(config.cache_dir).claims_path)
        try:
            assert table.sweep() == 4, "sweep left forged claims"
            assert table.held() == 0
        finally:
            table.close()


def test_a_garbled_claim_record_blocks_no_save(attack, tmp_path):
    config = StoreConfig(cache_dir=str(tmp_path / "c"))
    spec = tiny_spec()
    with KVStore(config, spec) as store:
        keys = store.keys_for(range(64))
        with store.claims._env.begin(write=True) as txn:
            for i, key in enumerate(keys):
                txn.put(key, b"\xff" * i)  # 0..3 bytes: no claim record
        with attack("claim record of the wrong size"):
            assert store.put(keys, block_tensors(spec, keys)).stored == 4
            assert store.claims.sweep() == 0  # put took them over, then released
            assert store.claims.held() == 0


def test_the_claims_table_is_private(attack, tmp_path):
    """The claims LMDB is created 0700/0600 whatever the umask (it holds the
    keys being saved), and with meminit (no leftover heap bytes in it)."""
    path = tmp_path / "claims"
    old = os.umask(0o022)
    try:
        table = ClaimTable(str(path))
        table.claim([b"k" * 16])
        table.close()
    finally:
        os.umask(old)
    with attack("claims: readable by other users"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        for name in os.listdir(path):
            mode = stat.S_IMODE(os.stat(path / name).st_mode)
            assert mode == 0o600, f"{name} is {mode:04o}"
