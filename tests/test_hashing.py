"""Block keys: the keyed chain formula of docs/format.md §4, golden vectors,
the key's effect, and independence from the process and PYTHONHASHSEED."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from npukv_store.hashing import chain_hashes, namespace_fingerprint
from tests.support.blocks import tiny_spec

GOLDEN_NS = b"\x00" * 16
K = bytes(range(32))  # the golden chain key
GOLDEN = [
    "625a7af1a1d83ec2a6d807fefda5fa4d",
    "82c4ffc61ee811c391d1fcee16c40630",
    "077f9eb816e08fe1b7d6bcf9dd28db06",
]
GOLDEN_EXTRA = [
    "9cef0150177257755ed4ef87780b710c",
    "cabff26845a01ca49e50bd5833a20e32",
]
GOLDEN_FINGERPRINT = "2fa4ccb47f21100754101ddf373c09a9"  # format 2


def test_golden_vectors():
    keys = chain_hashes(list(range(48)), 16, GOLDEN_NS, key=K)
    assert [k.hex() for k in keys] == GOLDEN
    extra = chain_hashes([7] * 33, 16, bytes(range(16)), extra=b"lora:1", key=K)
    assert [k.hex() for k in extra] == GOLDEN_EXTRA
    assert namespace_fingerprint(tiny_spec()).hex() == GOLDEN_FINGERPRINT


def keyed(data: bytes, key: bytes = K) -> bytes:
    return hashlib.blake2b(data, key=key, digest_size=16).digest()


def test_formula_matches_design():
    """h[-1] = B(K, ns); h[i] = B(K, h[i-1] || int32 LE tokens || extra), with
    B keyed BLAKE2b-128."""
    tokens = [5, -1, 2**31 - 1, 0]
    prev = keyed(b"ns")
    for i in range(2):
        raw = struct.pack("<2i", *tokens[2 * i : 2 * i + 2])
        prev = keyed(prev + raw + b"salt")
        assert chain_hashes(tokens, 2, b"ns", extra=b"salt", key=K)[i] == prev


def test_the_key_changes_every_key():
    """Without the chain key nobody can compute a block's key: two keys give
    unrelated chains, and no key is the unkeyed hash."""
    tokens = list(range(64))
    one = chain_hashes(tokens, 16, b"ns", key=K)
    other = chain_hashes(tokens, 16, b"ns", key=bytes(32))
    assert not set(one) & set(other)
    unkeyed = hashlib.blake2b(b"ns", digest_size=16).digest()
    assert unkeyed not in one + other


@pytest.mark.parametrize("length", [0, 15, 65])
def test_a_key_of_the_wrong_length_is_refused(length):
    with pytest.raises(ValueError, match="key: found"):
        chain_hashes(range(16), 16, b"ns", key=b"k" * length)


def test_only_full_blocks_and_parent_continues_chain():
    tokens = list(range(50))
    keys = chain_hashes(tokens, 16, b"ns", key=K)
    assert len(keys) == 3
    tail = chain_hashes(tokens[32:], 16, b"ns", parent=keys[1], key=K)
    assert tail == keys[2:]
    assert chain_hashes(tokens[:15], 16, b"ns", key=K) == []


def test_extra_and_namespace_change_keys():
    base = chain_hashes(range(32), 16, b"ns", key=K)
    assert chain_hashes(range(32), 16, b"other", key=K) != base
    per_block = chain_hashes(range(32), 16, b"ns", extra=[b"", b"mm:abc"], key=K)
    assert per_block[0] == base[0]
    assert per_block[1] != base[1]


def test_fingerprint_covers_layout_rank_and_extra():
    ref = namespace_fingerprint(tiny_spec())
    assert namespace_fingerprint(tiny_spec(num_layers=4)) != ref
    assert namespace_fingerprint(tiny_spec(tp_rank=1, tp_size=2)) != ref
    assert namespace_fingerprint(tiny_spec(extra="x")) != ref
    assert namespace_fingerprint(tiny_spec(revision="r2")) != ref
    # MLA latent KV is the same on every rank: stored once.
    mla = [tiny_spec(tp_rank=r, tp_size=4, rank_independent=True) for r in range(4)]
    assert len({namespace_fingerprint(s) for s in mla}) == 1


@pytest.mark.parametrize(
    ("tokens", "block", "extra"),
    [([2**31], 1, b""), ([[1, 2]], 1, b""), ([1, 2], 0, b""), ([1] * 32, 16, [b""])],
)
def test_bad_input_is_one_clear_error(tokens, block, extra):
    with pytest.raises(ValueError, match="found"):
        chain_hashes(tokens, block, b"ns", extra=extra, key=K)


@given(st.lists(st.integers(0, 2**31 - 1), max_size=80), st.integers(1, 9))
def test_prefix_property(tokens, block):
    """Keys of a prefix are a prefix of the keys: the basis of prefix lookup."""
    keys = chain_hashes(tokens, block, b"ns", key=K)
    cut = len(tokens) // 2
    assert chain_hashes(tokens[:cut], block, b"ns", key=K) == keys[: cut // block]
    assert all(len(k) == 16 for k in keys)


@pytest.mark.parametrize("seed", ["0", "1", "random"])
def test_same_in_other_processes_and_hash_seeds(seed):
    code = (
        "from npukv_store.hashing import chain_hashes;"
        "print(chain_hashes(list(range(48)), 16, bytes(16),"
        " key=bytes(range(32)))[2].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == GOLDEN[2]
