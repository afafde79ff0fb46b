"""Block keys: the keyed chain formula of docs/format.md §4, golden vectors,
the key's effect, the ranks' keys derived from one chain, and independence
from the process and PYTHONHASHSEED."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from npukv_store.hashing import (
    RANK_PERSON,
    chain_hashes,
    chain_links,
    chain_root,
    namespace_fingerprint,
    rank_keys,
)
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
GOLDEN_RANK_NS = b"\x01" * 16  # a rank whose chain is rooted at GOLDEN_NS
GOLDEN_RANK = [
    "a5820596d7f524389c5146538afcbcc5",
    "9536983af64f45b359f3b93be9b98d6e",
    "5aeede2606f6cd325d557372140f6a10",
]


def test_golden_vectors():
    keys = chain_hashes(list(range(48)), 16, GOLDEN_NS, key=K)
    assert [k.hex() for k in keys] == GOLDEN
    extra = chain_hashes([7] * 33, 16, bytes(range(16)), extra=b"lora:1", key=K)
    assert [k.hex() for k in extra] == GOLDEN_EXTRA
    assert namespace_fingerprint(tiny_spec()).hex() == GOLDEN_FINGERPRINT
    ranked = chain_hashes(list(range(48)), 16, GOLDEN_RANK_NS, key=K, root=GOLDEN_NS)
    assert [k.hex() for k in ranked] == GOLDEN_RANK


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


def test_a_rank_key_is_a_keyed_prf_of_the_shared_link():
    """key = B(K, person="npukv-rank-2", fingerprint || h[i]) off the root;
    at the root the key is the link itself (format 2's keys unchanged)."""
    links = chain_links(list(range(48)), 16, b"root", key=K)
    assert chain_hashes(list(range(48)), 16, b"root", key=K) == links
    derived = chain_hashes(list(range(48)), 16, b"rank-one", key=K, root=b"root")
    for link, key in zip(links, derived, strict=True):
        expected = hashlib.blake2b(
            b"rank-one" + link, key=K, digest_size=16, person=RANK_PERSON
        ).digest()
        assert key == expected
    assert rank_keys(links, b"root", b"root", key=K) == links
    assert not set(derived) & set(links)


def test_every_rank_of_a_spec_shares_its_rank_0_root():
    ranks = [tiny_spec(tp_rank=r, tp_size=4) for r in range(4)]
    assert {chain_root(s) for s in ranks} == {namespace_fingerprint(ranks[0])}
    assert chain_root(tiny_spec(tp_size=4, extra="x")) != chain_root(ranks[0])
    mla = tiny_spec(tp_rank=2, tp_size=4, rank_independent=True)
    assert chain_root(mla) == namespace_fingerprint(mla)


@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=80),
    st.integers(1, 9),
    st.binary(min_size=16, max_size=16),
)
def test_rank_keys_keep_the_prefix_property_and_continue(tokens, block, rank_ns):
    """A rank's keys of a prefix are a prefix of its keys, and a chain
    continued from a link gives the same keys as one computation."""
    keys = chain_hashes(tokens, block, rank_ns, key=K, root=b"root")
    cut = (len(tokens) // 2 // block) * block
    head = chain_hashes(tokens[:cut], block, rank_ns, key=K, root=b"root")
    assert head == keys[: cut // block]
    links = chain_links(tokens[:cut], block, b"root", key=K)
    parent = links[-1] if links else None
    tail = chain_hashes(
        tokens[cut:], block, rank_ns, parent=parent, key=K, root=b"root"
    )
    assert head + tail == keys


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
