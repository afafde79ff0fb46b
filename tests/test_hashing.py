"""Block keys: the chain formula of docs/format.md §4, golden vectors, and
independence from the process and PYTHONHASHSEED."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from npukv_store.hashing import chain_hashes, namespace_fingerprint
from tests.support.blocks import tiny_spec

GOLDEN_NS = b"\x00" * 16
GOLDEN = [
    "2a52b211e713755be03c392279c1c87b",
    "504648d89e14eb304dcd9daa22d30c75",
    "2c06cf19c5cf74d0bfb5117ecf890972",
]
GOLDEN_EXTRA = [
    "30021cec6ae14c2723639272b42c95a5",
    "7c3cb6ee1bf0ddae0bf84a41e323d9ed",
]
GOLDEN_FINGERPRINT = "f1a45dab3c243ca10f85abc6899b3bb2"


def test_golden_vectors():
    keys = chain_hashes(list(range(48)), 16, GOLDEN_NS)
    assert [k.hex() for k in keys] == GOLDEN
    extra = chain_hashes([7] * 33, 16, bytes(range(16)), extra=b"lora:1")
    assert [k.hex() for k in extra] == GOLDEN_EXTRA
    assert namespace_fingerprint(tiny_spec()).hex() == GOLDEN_FINGERPRINT


def test_formula_matches_design():
    """h[-1] = xxh3_128(ns); h[i] = xxh3_128(h[i-1] || int32 LE tokens || extra)."""
    tokens = [5, -1, 2**31 - 1, 0]
    prev = xxhash.xxh3_128_digest(b"ns")
    for i in range(2):
        raw = struct.pack("<2i", *tokens[2 * i : 2 * i + 2])
        prev = xxhash.xxh3_128_digest(prev + raw + b"salt")
        assert chain_hashes(tokens, 2, b"ns", extra=b"salt")[i] == prev


def test_only_full_blocks_and_parent_continues_chain():
    tokens = list(range(50))
    keys = chain_hashes(tokens, 16, b"ns")
    assert len(keys) == 3
    tail = chain_hashes(tokens[32:], 16, b"ns", parent=keys[1])
    assert tail == keys[2:]
    assert chain_hashes(tokens[:15], 16, b"ns") == []


def test_extra_and_namespace_change_keys():
    base = chain_hashes(range(32), 16, b"ns")
    assert chain_hashes(range(32), 16, b"other") != base
    per_block = chain_hashes(range(32), 16, b"ns", extra=[b"", b"mm:abc"])
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
        chain_hashes(tokens, block, b"ns", extra=extra)


@given(st.lists(st.integers(0, 2**31 - 1), max_size=80), st.integers(1, 9))
def test_prefix_property(tokens, block):
    """Keys of a prefix are a prefix of the keys: the basis of prefix lookup."""
    keys = chain_hashes(tokens, block, b"ns")
    cut = len(tokens) // 2
    assert chain_hashes(tokens[:cut], block, b"ns") == keys[: cut // block]
    assert all(len(k) == 16 for k in keys)


@pytest.mark.parametrize("seed", ["0", "1", "random"])
def test_same_in_other_processes_and_hash_seeds(seed):
    code = (
        "from npukv_store.hashing import chain_hashes;"
        "print(chain_hashes(list(range(48)), 16, bytes(16))[2].hex())"
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
