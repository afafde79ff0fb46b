"""The remote value of one block (npukv_store.remote.value): pure, no Mooncake.

Encoding then verifying is clean; any one byte changed anywhere is a reason;
the MAC is checked first and binds the header and checksums to the MAC key;
the reasons name what was found and what was expected; the layer checksums are
the chunk format's, so a saver can copy them from a chunk's checksum table;
key names are keyed and reveal neither namespace nor key.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store import native
from npukv_store.hashing import namespace_fingerprint
from npukv_store.remote.value import (
    MAC_BYTES,
    MAC_MISMATCH,
    PREFIX_BYTES,
    SUMS_OFFSET,
    VALUE_FORMAT,
    VALUE_MAGIC,
    ValueLayout,
    encode_value,
    remote_key,
    remote_keys,
    value_mac,
    verify_value,
)
from npukv_store.store.format import layer_checksums
from tests.support.blocks import block_tensors, tiny_spec

MK = b"m" * 32  # the MAC key of these tests
NK = b"n" * 32  # and the name key
ids16 = st.binary(min_size=16, max_size=16)


def encode(layout, fingerprint, key, layers, mac_key=MK):
    return encode_value(layout, fingerprint, key, layers, mac_key=mac_key)


def verify(layout, fingerprint, key, value, mac_key=MK):
    return verify_value(layout, fingerprint, key, value, mac_key=mac_key)


def resign(layout, value: np.ndarray, mac_key=MK) -> np.ndarray:
    """``value`` with its MAC made again over what it now holds (what only a
    holder of the MAC key can do): the field checks behind the MAC."""
    raw = value.tobytes()
    mac = value_mac(mac_key, raw[:PREFIX_BYTES], raw[SUMS_OFFSET : layout.header_bytes])
    value = value.copy()
    value[PREFIX_BYTES:SUMS_OFFSET] = np.frombuffer(mac, np.uint8)
    return value


layer_sizes = st.lists(st.integers(1, 700), min_size=1, max_size=6).map(tuple)


@st.composite
def values(draw):
    """(layout, fingerprint, key, layers, encoded value as uint8)."""
    layout = ValueLayout(draw(layer_sizes))
    fingerprint, key = draw(ids16), draw(ids16)
    layers = [draw(st.binary(min_size=n, max_size=n)) for n in layout.layer_bytes]
    value = np.frombuffer(encode(layout, fingerprint, key, layers), np.uint8)
    return layout, fingerprint, key, layers, value.copy()


@settings(max_examples=200, deadline=None)
@given(values())
def test_encoded_value_verifies_and_lays_out_as_documented(case):
    layout, fingerprint, key, layers, value = case
    assert value.size == layout.value_bytes
    assert layout.header_bytes == PREFIX_BYTES + MAC_BYTES + 8 * len(layers)
    assert verify(layout, fingerprint, key, value) == ""
    raw = value.tobytes()
    assert raw[:PREFIX_BYTES] == layout.prefix(fingerprint, key)
    magic, fmt, count, data_bytes, ns, found_key, reserved = struct.unpack_from(
        "<8sIIQ16s16sQ", raw
    )
    assert (magic, fmt, count, data_bytes) == (
        VALUE_MAGIC, VALUE_FORMAT, len(layers), sum(map(len, layers)),
    )  # fmt: skip
    assert (ns, found_key, reserved) == (fingerprint, key, 0)
    sums = raw[SUMS_OFFSET : layout.header_bytes]
    assert raw[PREFIX_BYTES:SUMS_OFFSET] == value_mac(MK, raw[:PREFIX_BYTES], sums)
    for index, layer in enumerate(layers):
        begin = layout.layer_offset(index)
        assert raw[begin : begin + len(layer)] == layer
    assert layout.layer_offset(len(layers) - 1) + len(layers[-1]) == len(raw)


@settings(max_examples=300, deadline=None)
@given(values(), st.data())
def test_any_single_byte_change_is_a_reason(case, data):
    layout, fingerprint, key, _, value = case
    index = data.draw(st.integers(0, value.size - 1), label="byte")
    delta = data.draw(st.integers(1, 255), label="xor")
    value[index] ^= delta
    why = verify(layout, fingerprint, key, value)
    assert why, f"byte {index} of {value.size} changed (^{delta:#x}) yet verified"


@pytest.mark.parametrize(
    "region",
    ["magic", "format", "num_layers", "data_bytes", "namespace", "key", "reserved",
     "mac", "checksums", "data"],
)  # fmt: skip
def test_every_region_of_the_value_is_checked(region):
    """The same, deterministically, for one byte of each region (hypothesis may
    not draw the 8 reserved bytes of a long value often): the header's bytes
    fail the MAC, and fail their own check too when the MAC is made again
    (a node of the same secret with a bug), the data its checksum."""
    layout = ValueLayout((300, 200))
    fingerprint, key = b"N" * 16, b"K" * 16
    value = np.frombuffer(
        encode(layout, fingerprint, key, [b"a" * 300, b"b" * 200]), np.uint8
    ).copy()
    offset = {
        "magic": 0, "format": 8, "num_layers": 12, "data_bytes": 16,
        "namespace": 24, "key": 40, "reserved": 56, "mac": 64, "checksums": 80,
        "data": layout.header_bytes + 250,
    }[region]  # fmt: skip
    for delta in (1, 0x80):
        changed = value.copy()
        changed[offset] ^= delta
        why = verify(layout, fingerprint, key, changed)
        assert why, region
        if region == "data":
            assert why.startswith("layer 0 checksum"), why
            continue
        assert why.startswith(MAC_MISMATCH), why
        if region != "mac":
            assert verify(layout, fingerprint, key, resign(layout, changed)), region


@settings(max_examples=100, deadline=None)
@given(values(), ids16)
def test_wrong_namespace_names_both(case, other):
    layout, fingerprint, key, _, value = case
    if other == fingerprint:
        return
    why = verify(layout, other, key, value)
    assert "namespace" in why
    assert fingerprint.hex()[:12] in why  # found
    assert other.hex()[:12] in why  # expected


@settings(max_examples=100, deadline=None)
@given(values(), ids16)
def test_wrong_key_names_both(case, other):
    layout, fingerprint, key, _, value = case
    if other == key:
        return
    why = verify(layout, fingerprint, other, value)
    assert "key" in why
    assert key.hex() in why
    assert other.hex() in why


@settings(max_examples=100, deadline=None)
@given(values(), st.integers(-64, 64).filter(bool))
def test_wrong_length_names_both(case, change):
    layout, fingerprint, key, _, value = case
    size = value.size + change
    if size < 0:
        return
    resized = np.zeros(size, np.uint8)
    resized[: min(size, value.size)] = value[: min(size, value.size)]
    why = verify(layout, fingerprint, key, resized)
    assert f"{size} bytes" in why
    assert str(layout.value_bytes) in why


@settings(max_examples=50, deadline=None)
@given(values(), layer_sizes)
def test_value_of_another_layout_is_a_reason(case, other_sizes):
    """A value read with a layout of the same total size but other layers (a
    namespace that changed shape) is refused, not misread."""
    layout, fingerprint, key, _, value = case
    other = ValueLayout(other_sizes)
    if other.layer_bytes == layout.layer_bytes or other.value_bytes != value.size:
        return
    assert verify(other, fingerprint, key, value)


def test_reason_for_a_layout_change_names_layers_and_bytes():
    value = np.frombuffer(
        encode(ValueLayout((8, 8)), b"N" * 16, b"K" * 16, [b"x" * 8] * 2),
        np.uint8,
    )
    # same total size (80 + 16 + 16 = 80 + 8 + 24), one layer fewer: the MAC
    # covers the checksums the reader's layout places, which differ here
    other = ValueLayout((24,))
    assert verify(other, b"N" * 16, b"K" * 16, value).startswith(MAC_MISMATCH)
    why = verify(other, b"N" * 16, b"K" * 16, resign(other, value))
    assert why == "2 layers of 16 bytes, expected 1 of 24"


def test_wrong_magic_and_format_name_both():
    layout = ValueLayout((16,))
    value = np.frombuffer(
        encode(layout, b"N" * 16, b"K" * 16, [b"z" * 16]), np.uint8
    ).copy()
    bad_magic = value.copy()
    bad_magic[:8] = np.frombuffer(b"NOTABLOK", np.uint8)
    assert verify(layout, b"N" * 16, b"K" * 16, bad_magic).startswith(MAC_MISMATCH)
    why = verify(layout, b"N" * 16, b"K" * 16, resign(layout, bad_magic))
    assert "NOTABLOK" in why
    assert "NPUKVBLK" in why
    bad_format = value.copy()
    bad_format[8:12] = np.frombuffer(struct.pack("<I", 7), np.uint8)
    # an old or newer node's value: the MAC fails, and the reason says why
    assert verify(layout, b"N" * 16, b"K" * 16, bad_format) == (
        f"{MAC_MISMATCH} (a format 7 value, expected {VALUE_FORMAT})"
    )
    assert verify(layout, b"N" * 16, b"K" * 16, resign(layout, bad_format)) == (
        f"format 7, expected {VALUE_FORMAT}"
    )


@settings(max_examples=100, deadline=None)
@given(values(), st.binary(min_size=16, max_size=64))
def test_a_value_under_another_mac_key_fails_its_mac(case, other_key):
    layout, fingerprint, key, _, value = case
    if other_key == MK:
        return
    why = verify(layout, fingerprint, key, value, mac_key=other_key)
    assert why.startswith(MAC_MISMATCH), why


def test_sign_writes_the_mac_encode_value_writes():
    """The save path's MAC (ValueLayout.sign over values laid out in place)
    is encode_value's, byte for byte."""
    layout = ValueLayout((40, 24, 40))
    rng = np.random.default_rng(3)
    keys = [bytes([i]) * 16 for i in range(4)]
    layers = [[rng.bytes(n) for n in layout.layer_bytes] for _ in keys]
    whole = np.stack([
        np.frombuffer(encode(layout, b"F" * 16, k, ls), np.uint8)
        for k, ls in zip(keys, layers, strict=True)
    ])  # fmt: skip
    laid = whole.copy()
    laid[:, PREFIX_BYTES:SUMS_OFFSET] = 0
    layout.sign(MK, laid)
    assert np.array_equal(laid, whole)


@settings(max_examples=100, deadline=None)
@given(ids16, ids16, ids16)
def test_remote_key_separates_namespaces(ns_a, ns_b, key):
    name = remote_key(ns_a, key, NK)
    prefix, _, digest = name.partition("/")
    assert prefix == "npukv"
    assert len(digest) == 32
    assert int(digest, 16) >= 0  # lowercase hex
    assert digest == digest.lower()
    assert ns_a.hex() not in name
    assert key.hex() not in name
    assert remote_keys(ns_a, [key, ns_b], NK) == [name, remote_key(ns_a, ns_b, NK)]
    if ns_a != ns_b:
        assert remote_key(ns_a, key, NK) != remote_key(ns_b, key, NK)


@settings(max_examples=100, deadline=None)
@given(ids16, ids16, st.binary(min_size=16, max_size=64))
def test_remote_key_depends_on_the_name_key(ns, key, other):
    if other != NK:
        assert remote_key(ns, key, NK) != remote_key(ns, key, other)


def test_remote_keys_of_two_models_differ():
    """Two models sharing a master: their fingerprints, hence keys, differ."""
    a, b = tiny_spec(model="model-a"), tiny_spec(model="model-b")
    fa, fb = namespace_fingerprint(a), namespace_fingerprint(b)
    assert fa != fb
    assert remote_key(fa, b"\x01" * 16, NK) != remote_key(fb, b"\x01" * 16, NK)


def test_for_spec_takes_each_layers_bytes():
    spec = tiny_spec(num_layers=4)
    layout = ValueLayout.for_spec(spec)
    assert layout.layer_bytes == (1024,) * 4  # k + v, 512 B each
    assert layout.value_bytes == 80 + 8 * 4 + 4 * 1024


@pytest.mark.parametrize("num_layers", [1, 3])
def test_layer_checksums_are_the_chunk_formats(num_layers):
    """The value's checksum of layer i equals the chunk format's checksum of the
    same rows (layer_checksums over the layer's parts, as a chunk's checksum
    table holds it), for several blocks at once: a saver can copy the table."""
    spec = tiny_spec(num_layers=num_layers)
    layout = ValueLayout.for_spec(spec)
    fingerprint = namespace_fingerprint(spec)
    keys = [bytes([i]) * 16 for i in range(5)]
    tensors = block_tensors(spec, keys)
    chunk_sums = np.stack(
        [
            layer_checksums(
                [tensors[f"{layer.name}.{part.name}"] for part in layer.parts],
                len(keys),
            )
            for layer in spec.layers
        ],
        axis=1,
    )  # [blocks, layers], as the chunk's checksum table
    for row, key in enumerate(keys):
        layers = [
            b"".join(
                tensors[f"{layer.name}.{part.name}"][row].tobytes()
                for part in layer.parts
            )
            for layer in spec.layers
        ]
        value = encode(layout, fingerprint, key, layers)
        sums = np.frombuffer(value, "<u8", count=num_layers, offset=SUMS_OFFSET)
        assert sums.tolist() == chunk_sums[row].tolist()
        # and the one-part form: xxh3 of the layer's bytes as a single row
        for index, data in enumerate(layers):
            one = native.xxh3_rows([np.frombuffer(data, np.uint8)], 1)
            assert int(one[0]) == int(sums[index])
        assert verify(layout, fingerprint, key, np.frombuffer(value, np.uint8)) == ""


def test_encode_refuses_layers_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"found sizes \[3\], expected \[4\]"):
        encode(ValueLayout((4,)), b"N" * 16, b"K" * 16, [b"abc"])
