"""Chunk files: safetensors compatibility, strict validation of untrusted files,
and a mutation fuzz proving the reader never crashes, hangs or returns bad rows."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from npukv_store import KVStore
from npukv_store.errors import (
    BadMagic,
    CorruptChunk,
    FormatError,
    NamespaceMismatch,
    VersionMismatch,
)
from npukv_store.hashing import chain_hashes
from npukv_store.store.format import DATA_ALIGN, MAX_HEADER_BYTES, build_chunk
from npukv_store.store.format_checks import parse_header
from tests.support.blocks import block_tensors, empty_blocks, tiny_spec

SPEC = tiny_spec()
NS = "ab" * 16
KEYS = chain_hashes(range(16 * 4), 16, b"fmt", key=b"k" * 32)


def chunk_bytes(spec=SPEC, keys=KEYS, namespace=NS) -> bytes:
    rows = {
        n: np.ascontiguousarray(a).data.cast("B")
        for n, a in block_tensors(spec, keys).items()
    }
    buffers = build_chunk(spec, namespace, keys, rows, creator="1@h", created_ns=5)
    return b"".join(bytes(b) for b in buffers)


def parse_bytes(tmp_path, data: bytes, **kw):
    path = tmp_path / "c.safetensors"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        return parse_header(fd, str(path), **kw)
    finally:
        os.close(fd)


def rewrite_header(data: bytes, edit) -> bytes:
    (length,) = struct.unpack_from("<Q", data)
    body = json.loads(data[8 : 8 + length])
    edit(body)
    text = json.dumps(body).encode()
    text += b" " * (length - len(text))
    assert len(text) == length, "test edit must not grow the header"
    return data[:8] + text + data[8 + length :]


def test_roundtrip_with_safetensors(tmp_path):
    data = chunk_bytes()
    header = parse_bytes(tmp_path, data, namespace=NS, spec=SPEC)
    assert header.data_start % DATA_ALIGN == 0
    assert header.keys == tuple(KEYS)
    expected = block_tensors(SPEC, KEYS)
    with safe_open(str(tmp_path / "c.safetensors"), "np") as handle:
        assert handle.metadata()["npukv_namespace"] == NS
        for name, array in expected.items():
            np.testing.assert_array_equal(handle.get_tensor(name), array)
        sums = handle.get_tensor("__npukv_checksums__")
    np.testing.assert_array_equal(sums, header.checksums)
    # layer-major: one layer of the chunk is one contiguous byte range
    for layer in header.layers:
        assert all(a.end == b.begin for a, b in zip(layer, layer[1:], strict=False))


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda d: d[:4], BadMagic, "expected a chunk"),
        (lambda d: struct.pack("<Q", 1 << 60) + d[8:], CorruptChunk, "header length"),
        (lambda d: d[:8] + b"\xff" + d[9:], BadMagic, "not JSON"),
        (lambda d: d[:-1], CorruptChunk, "expected EOF|data_offsets"),
        (lambda d: d + b"\0", CorruptChunk, "expected EOF"),
    ],
)
def test_structural_damage_raises(tmp_path, mutate, error, match):
    with pytest.raises(error, match=match):
        parse_bytes(tmp_path, mutate(chunk_bytes()))


def _set_meta(key, value):
    return lambda body: body["__metadata__"].__setitem__(key, value)


def _drop_meta(key):
    return lambda body: body["__metadata__"].pop(key)


def _set_tensor(name, field, value):
    return lambda body: body[name].__setitem__(field, value)


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (_drop_meta("npukv_format"), BadMagic, "not an npukv chunk"),
        (_set_meta("npukv_format", "3"), VersionMismatch, "expected '2'"),
        (_drop_meta("npukv_keys"), CorruptChunk, "lacks"),
        (_set_meta("npukv_keys", "zz"), CorruptChunk, "garbled"),
        (_set_meta("npukv_layers", "[1]"), CorruptChunk, "distinct names"),
        (_set_tensor("model.layers.0.attn.k", "dtype", "F64"), CorruptChunk, "bytes"),
        (_set_tensor("model.layers.0.attn.k", "shape", [4, -1]), CorruptChunk, "shape"),
        (
            _set_tensor("model.layers.0.attn.k", "data_offsets", [0, 1 << 40]),
            CorruptChunk,
            "data_offsets",
        ),
        (_set_tensor("model.layers.1.attn.v", "shape", [4, 16, 4, 4]), None, None),
    ],
)
def test_header_damage_raises(tmp_path, edit, error, match):
    data = rewrite_header(chunk_bytes(), edit)
    if error is None:  # same byte count, other logical shape: layout mismatch
        parse_bytes(tmp_path, data)
        with pytest.raises(CorruptChunk, match="namespace layout"):
            parse_bytes(tmp_path, data, spec=SPEC)
        return
    with pytest.raises(error, match=match):
        parse_bytes(tmp_path, data)


def test_other_namespace_and_bounded_header(tmp_path):
    with pytest.raises(NamespaceMismatch, match="expected"):
        parse_bytes(tmp_path, chunk_bytes(), namespace="cd" * 16)
    huge = struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{" + b" " * 100
    with pytest.raises(CorruptChunk, match="does not fit"):
        parse_bytes(tmp_path, huge)


MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**7), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**7), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**7), st.integers(0, 255)),
    st.tuples(st.just("zero_page"), st.integers(0, 10**7), st.just(0)),
)


def apply_mutations(data: bytes, mutations) -> bytes:
    buf = bytearray(data)
    for kind, pos, value in mutations:
        if not buf:
            break
        pos %= len(buf)
        if kind == "flip":
            buf[pos] ^= value
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "insert":
            buf.insert(pos, value)
        else:
            buf[pos : pos + 4096] = bytes(len(buf[pos : pos + 4096]))
    return bytes(buf)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(MUTATION, min_size=1, max_size=4))
@pytest.mark.timeout(300)
def test_fuzz_reader_never_returns_wrong_bytes(tmp_path_factory, mutations):
    """Mutate a published chunk in place; every read is exact bytes or a miss."""
    from npukv_store import StoreConfig

    root = tmp_path_factory.mktemp("fuzz")
    config = StoreConfig(cache_dir=str(root / "c"), fsync="never")
    with KVStore(config, SPEC) as writer:
        keys = writer.keys_for(range(16 * 4))
        expected = block_tensors(SPEC, keys)
        writer.put(keys, expected)
        (path,) = [
            os.path.join(dp, f)
            for dp, _, fs in os.walk(root)
            for f in fs
            if f.endswith(".safetensors")
        ]
    with open(path, "rb") as handle:
        original = handle.read()
    with open(path, "wb") as handle:
        handle.write(apply_mutations(original, mutations))
    fd = os.open(path, os.O_RDONLY)
    try:
        parse_header(fd, path)
    except FormatError:
        pass  # the one allowed failure mode of the parser
    finally:
        os.close(fd)
    with KVStore(config, SPEC) as reader:  # fresh handle: no cached header
        out = empty_blocks(SPEC, len(keys))
        ok = reader.read(keys, out)
        for i, hit in enumerate(ok):
            if hit:
                for name, array in expected.items():
                    np.testing.assert_array_equal(out[name][i], array[i])
