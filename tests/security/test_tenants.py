"""Tenants and pins name no salt and no prompt (docs/decisions/0067): a
tenant's digest and a pin's digests are keyed with the cache secret, so a
reader of the directory (a copy of it, a leaked `npukv stats`) learns
neither the cache salts nor the pinned prompt, and cannot test a guess."""

from __future__ import annotations

import json
import os

from npukv_store.cli import main
from npukv_store.keying import tenant_digest
from npukv_store.store.pins import pin_digests
from npukv_store.store.store import KVStore
from tests.support.blocks import block_tensors, tiny_spec
from tests.support.connector import settings as store_settings

SALT = "acme-corp-tenant-salt"
PROMPT = [(31 * i + 7) % 50_000 for i in range(64)]


def _every_byte(root: str) -> bytes:
    blob = b""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                blob += handle.read()
    return blob


def test_neither_the_salt_nor_the_pinned_prompt_is_in_the_directory(
    attack, tmp_path, capsys
):
    config = store_settings(tmp_path)
    spec = tiny_spec()
    ids = tmp_path / "prompt.json"
    ids.write_text(json.dumps(PROMPT))
    with attack("tenants: the cache salt or the pinned prompt in the directory"):
        with KVStore(config, spec) as store:
            keys = [os.urandom(16) for _ in range(3)]
            store.put(keys, block_tensors(spec, keys), tenant=store.tenant(SALT))
        assert main(["pin", config.cache_dir, "--token-ids-file", str(ids),
                     "--cache-salt", SALT, "--label", "sys"]) == 0  # fmt: skip
        printed = capsys.readouterr().out
        assert main(["stats", config.cache_dir, "--json"]) == 0
        shown = capsys.readouterr().out
        assert SALT not in printed
        blob = _every_byte(config.cache_dir)
        assert SALT.encode() not in blob
        assert SALT not in shown
        tokens = b"".join(t.to_bytes(4, "little") for t in PROMPT[:16])
        assert tokens not in blob
        # unkeyed, or keyed with a guessable key, the digests would be found
        for guess in (b"", bytes(32)):
            assert tenant_digest(guess, SALT).hex() not in shown
            digest = pin_digests(guess, SALT, PROMPT)[0].hex()
            assert digest not in json.dumps(json.loads(shown)["pins"])
