"""Block keys carry a secret, and every field of a request's context is
tagged: attacks on the keys themselves (issue 26, part 4; docs/security.md).

Each attack worked on the unkeyed xxh3 chain of format 1, where anyone who
could read index/ computed a guessed prompt's keys, and where a LoRA named
"X" and a cache salt "X" shared block 0's key.
"""

from __future__ import annotations

import hashlib
import os
import stat
from types import SimpleNamespace

import lmdb
import pytest
import xxhash

from npukv_store.config import StoreConfig
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.errors import ConfigError, VersionMismatch
from npukv_store.hashing import chain_hashes
from npukv_store.keying import KeyDomain, read_secret_file
from npukv_store.store.store import KVStore
from tests.support.blocks import tiny_spec
from tests.support.connector import BLOCK, engine_config, make_request, put_blocks
from tests.support.connector import settings as store_settings

PROMPT = list(range(100, 100 + 8 * BLOCK + 1))


def _block0(side: SchedulerSide, request) -> bytes:
    ((keys,),) = side._keys(side._state(request), 1)
    return keys[0]


def _lora(name: str, path: str):
    return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=1)


def _index_keys(cache_dir) -> set[bytes]:
    """Every key of the index, read as an attacker with a copy of index/."""
    env = lmdb.open(str(cache_dir / "index"), readonly=True, lock=False, max_dbs=16)
    found: set[bytes] = set()
    try:
        with env.begin() as txn:
            for name, _ in txn.cursor():
                try:
                    db = env.open_db(name, txn=txn, create=False)
                except lmdb.Error:
                    continue
                for key, _ in txn.cursor(db):
                    found.add(bytes(key))
    finally:
        env.close()
    return found


def _untagged_extra_keys(request, start, end, mm_index):
    """vLLM 0.23's extra keys: the adapter's name and the salt as bare
    strings, so a LoRA "X" and a salt "X" give the same tuple."""
    keys: list[str] = []
    if request.lora_request is not None:
        keys.append(request.lora_request.lora_name)
    if start == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return (tuple(keys) or None), mm_index


@pytest.mark.parametrize("extra_keys", ["vllm", "untagged"])
def test_lora_and_salt_of_one_name_never_share_block_zero(
    tmp_path, attack, monkeypatch, extra_keys
):
    if extra_keys == "untagged":
        import vllm.v1.core.kv_cache_utils as utils

        monkeypatch.setattr(
            utils, "generate_block_hash_extra_keys", _untagged_extra_keys
        )
    side = SchedulerSide(*engine_config(), store_settings(tmp_path))
    try:
        with attack("keys: LoRA 'X' and cache salt 'X' share block 0"):
            lora = make_request("a", PROMPT)
            lora.lora_request = _lora("X", "")
            salted = make_request("b", PROMPT, salt="X")
            assert _block0(side, lora) != _block0(side, salted)
        with attack("keys: two salts share a key"):
            one = make_request("c", PROMPT, salt="tenant-1")
            two = make_request("d", PROMPT, salt="tenant-2")
            ((k1,),) = side._keys(side._state(one), 8)
            ((k2,),) = side._keys(side._state(two), 8)
            assert not set(k1) & set(k2)
        with attack("keys: adapter re-pointed under its name shares keys"):
            old = make_request("e", PROMPT)
            old.lora_request = _lora("sql", "/adapters/v1")
            new = make_request("f", PROMPT)
            new.lora_request = _lora("sql", "/adapters/v2")
            assert _block0(side, old) != _block0(side, new)
    finally:
        side.close()


def test_a_guessed_prompt_cannot_be_tested_offline(tmp_path, attack):
    """An attacker with a copy of index/ (but not the 0600 secret) computes
    the keys of a guessed prompt every way it can: none is in the index."""
    cfg = store_settings(tmp_path)
    side = SchedulerSide(*engine_config(), cfg)
    try:
        request = make_request("v", PROMPT)
        ((keys,),) = side._keys(side._state(request), 8)
        put_blocks(cfg, side.engine.specs[0][0], keys)
        fingerprint = side.fingerprints[0][0]
    finally:
        side.close()
    stored = _index_keys(tmp_path / "cache")
    assert set(keys) <= stored  # the victim's blocks are there
    with attack("keys: offline membership test with the format-1 chain"):
        prev = xxhash.xxh3_128_digest(fingerprint)
        raw = b"".join(t.to_bytes(4, "little", signed=True) for t in PROMPT)
        guesses = []
        for i in range(8):
            prev = xxhash.xxh3_128_digest(
                prev + raw[i * BLOCK * 4 : (i + 1) * BLOCK * 4]
            )
            guesses.append(prev)
        assert not set(guesses) & stored
    with attack("keys: offline membership test with a guessed chain key"):
        for guess in (bytes(32), hashlib.sha256(b"npukv").digest(), fingerprint * 2):
            assert not set(chain_hashes(PROMPT, BLOCK, fingerprint, key=guess)) & stored


def test_each_cache_has_its_own_secret_kept_across_restarts(tmp_path, attack):
    spec = tiny_spec()
    one = StoreConfig(cache_dir=str(tmp_path / "one"), ring_size="4MiB")
    two = StoreConfig(cache_dir=str(tmp_path / "two"), ring_size="4MiB")
    with KVStore(one, spec) as store:
        first = store.keys_for(PROMPT)
    with KVStore(one, spec) as store:
        assert store.keys_for(PROMPT) == first  # a restart finds its blocks
    with attack("keys: two caches derive the same keys"), KVStore(two, spec) as store:
        assert not set(store.keys_for(PROMPT)) & set(first)
    with attack("keys: the secret file is readable by others"):
        mode = stat.S_IMODE(os.stat(tmp_path / "one" / "secret").st_mode)
        assert mode & 0o077 == 0, f"secret has mode {mode:04o}"
    secret = (tmp_path / "one" / "secret").read_bytes()
    assert len(secret) == 32


def test_nodes_of_one_remote_tier_share_a_chain_and_no_one_else(tmp_path, attack):
    shared = tmp_path / "tier.secret"
    shared.write_bytes(os.urandom(32))
    shared.chmod(0o600)
    args = dict(remote_store="mooncake", remote_secret_file=str(shared))
    node_a = KeyDomain.for_config(os.urandom(32), **args)
    node_b = KeyDomain.for_config(os.urandom(32), **args)
    assert node_a.chain_key == node_b.chain_key
    assert node_a.remote is not None
    with attack("keys: remote secret's derived keys coincide"):
        assert node_a.remote.name_key != node_a.chain_key
        assert node_a.remote.mac_key not in (node_a.chain_key, node_a.remote.name_key)
    with attack("keys: a tier without the secret file derives the tier's keys"):
        alone = KeyDomain.for_config(os.urandom(32), remote_store="mooncake")
        assert alone.remote is None
        assert alone.chain_key != node_a.chain_key


@pytest.mark.parametrize("mode", [0o644, 0o604])
def test_a_secret_file_others_can_read_is_refused(tmp_path, attack, mode):
    path = tmp_path / "tier.secret"
    path.write_bytes(os.urandom(32))
    path.chmod(mode)
    with (
        attack("keys: a world-readable remote secret is used"),
        pytest.raises(ConfigError, match="no access for other users"),
    ):
        read_secret_file(str(path), what="remote_secret_file")
    link = tmp_path / "link.secret"
    link.symlink_to(path)
    with (
        attack("keys: a symlinked secret file is followed"),
        pytest.raises(ConfigError, match="symlink"),
    ):
        read_secret_file(str(link), what="remote_secret_file")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a file as another uid")
def test_a_group_members_secret_is_read_only_in_group_mode(tmp_path, attack):
    """cache_group: another member made the cache, so its secret is theirs;
    the group's gid admits it, and nothing else does."""
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(32))
    path.chmod(0o640)
    os.chown(path, 1234, 4321)
    assert read_secret_file(str(path), what="secret", gid=4321)
    with (
        attack("keys: a secret of another user and group is used"),
        pytest.raises(ConfigError, match="owned by uid 1234"),
    ):
        read_secret_file(str(path), what="secret", gid=None)
    with (
        attack("keys: a secret of another user and another group is used"),
        pytest.raises(ConfigError, match="owned by uid 1234"),
    ):
        read_secret_file(str(path), what="secret", gid=4322)


def test_a_format_1_directory_is_refused_naming_the_way_out(tmp_path):
    """Format-1 keys are unkeyed hashes of prompts we do not have: no
    migration can rekey them, so the open says what to do instead."""
    cfg = StoreConfig(cache_dir=str(tmp_path / "old"), ring_size="4MiB")
    with KVStore(cfg, tiny_spec()):
        pass
    marker = tmp_path / "old" / "NPUKV_STORE"
    marker.write_text(
        marker.read_text().replace('"format_version": 2', '"format_version": 1')
    )
    with pytest.raises(VersionMismatch, match="no migration: remove the directory"):
        KVStore(cfg, tiny_spec())
