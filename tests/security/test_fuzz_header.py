"""Fuzz the chunk header parser (npukv_store/store/format_checks.py) with
mutations of a real chunk: bit flips, byte replacements, truncations,
insertions, a wrong length prefix, numbers replaced by huge, negative or
non-numeric values, and edits of the JSON structure (keys dropped, values of
the wrong type, tensors swapped, renamed or added, metadata garbled).

Chunk files are untrusted: the only allowed outcomes are a header that passes
every check below or a FormatError (a miss). Anything else raised (ValueError,
TypeError, OverflowError, RecursionError, struct.error, MemoryError...) is a
crash. Seeded, so a failure names an input that can be replayed.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from npukv_store.errors import FormatError
from npukv_store.spec import CHECKSUM_TENSOR
from npukv_store.store.format import (
    DATA_ALIGN,
    MAX_CHECKSUM_CELLS,
    MAX_CHUNK_BLOCKS,
    MAX_CREATED_NS_DIGITS,
    MAX_CREATOR_CHARS,
    MAX_HEADER_BYTES,
    META_CREATED_NS,
    META_CREATOR,
    ChunkHeader,
    ChunkLayout,
    build_chunk,
)
from npukv_store.store.format_checks import parse_header
from tests.support.blocks import block_tensors, tiny_spec

SEED = 0x5EC_F022
TRIALS = int(os.environ.get("NPUKV_FUZZ_TRIALS", "100000"))
SPEC = tiny_spec(num_layers=2)
NS = "ab" * 16
KEYS = [bytes([i]) * 16 for i in range(1, 4)]

NUMBERS = [
    "0", "-1", "-4096", "1", "7", "4095", "4096", "4097", str(2**31), str(2**32 - 1),
    str(2**40), str(2**63 - 1), str(2**63), str(2**64), str(2**64 + 1), "9" * 4300,
    "9" * 4301, "9" * 5000, "-" + "9" * 5000, "1.5", "1e400", "-1e400", "NaN",
    "Infinity", "-Infinity", "null", "true", '"1"', '""', "[]", "{}", "[1]",
    "[" * 2000 + "]" * 2000, "1" + "0" * 20,
]  # fmt: skip
VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**63, 2**64, 1.5, float("inf"), "", "x", "F16", "U64",
    "٣", "0" * 40, [], {}, [0], [-1, 1], [0, 2**62], [[1]], {"a": 1}, ["F16"],
    [1] * 9, [2**40] * 2, list(range(100)),
]  # fmt: skip
NUMBER_RE = re.compile(r"-?\d+")
JSON_TOKENS = [b",", b"{", b"}", b"[", b"]", b'"', b":", b"null"]
JSON_BYTES = b'"{}[],:-.0123456789eE\\ \x00\xff'
# Built once: the large values are most of a mutation's cost otherwise.
CREATED_NS = ["", "-1", "1" * 19, "1" * 20, "9" * 5000, "١٢", " 1", "1_0", "0x10"]
CREATORS = [f"{2**31}@host", "9" * 5000 + "@h", "x" * 10**4, "@", "", "-1@h"]
LAYER_LISTS = [
    "[]", "[1]", '["a","a"]', "{}", "[" * 5000 + "]" * 5000, "9" * 5000,
    json.dumps([f"l{i}" for i in range(5000)]), "null", '"x"',
]  # fmt: skip
TOO_MANY_KEYS = "00" * 16 * (MAX_CHUNK_BLOCKS + 1)  # a header of 2 MiB


def _real_chunk() -> tuple[bytes, bytes]:
    """(header JSON text, data section) of a real chunk of ``KEYS``."""
    rows = {
        name: np.ascontiguousarray(array).data.cast("B")
        for name, array in block_tensors(SPEC, KEYS).items()
    }
    buffers = build_chunk(SPEC, NS, KEYS, rows, creator="12345@host", created_ns=17)
    data = b"".join(bytes(b) for b in buffers)
    (length,) = struct.unpack_from("<Q", data)
    return data[8 : 8 + length].rstrip(b" "), data[8 + length :]


def _frame(text: bytes, data: bytes, length: int | None = None) -> bytes:
    """A chunk file of header ``text`` padded to a 4096 multiple (or under the
    length prefix ``length``), then ``data``."""
    total = -(-(8 + len(text)) // DATA_ALIGN) * DATA_ALIGN
    if length is None:
        length = total - 8
    return struct.pack("<Q", length % 2**64) + text.ljust(total - 8) + data


# -- mutations: each takes (rng, header text, data) and returns file bytes ----


def _bytes_edit(rng: random.Random, text: bytes, data: bytes) -> bytes:
    buf = bytearray(_frame(text, data))
    span = len(text) + 8 if rng.random() < 0.9 else len(buf)  # mostly the header
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(span)
        kind = rng.randrange(4)
        if kind == 0:
            buf[pos] ^= 1 << rng.randrange(8)
        elif kind == 1:
            syntax = rng.random() < 0.7  # mostly JSON's own characters
            buf[pos] = rng.choice(JSON_BYTES) if syntax else rng.randrange(256)
        elif kind == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        else:
            del buf[pos : pos + rng.randint(1, 16)]
    return bytes(buf)


def _truncate(rng: random.Random, text: bytes, data: bytes) -> bytes:
    whole = _frame(text, data)
    return whole[: rng.randrange(len(whole))]


def _length_prefix(rng: random.Random, text: bytes, data: bytes) -> bytes:
    length = rng.choice(
        [0, 1, 7, 8, len(text), len(text) - 1, DATA_ALIGN - 8, DATA_ALIGN,
         MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1, rng.randrange(2**64)]
    )  # fmt: skip
    return _frame(text, data, length)


def _text_edit(rng: random.Random, text: bytes, data: bytes) -> bytes:
    """Insert, delete or duplicate a run of the JSON text (the length prefix
    follows it, so the parse sees the edit)."""
    out = text
    for _ in range(rng.randint(1, 3)):
        a = rng.randrange(len(out) + 1)
        b = min(len(out), a + rng.randint(1, 64))
        kind = rng.randrange(3)
        if kind == 0:
            out = out[:a] + rng.choice(JSON_TOKENS) + out[a:]
        elif kind == 1:
            out = out[:a] + out[b:]
        else:
            out = out[:b] + out[a:b] + out[b:]
    return _frame(out, data)


def _number(rng: random.Random, text: bytes, data: bytes) -> bytes:
    """One or more numbers of the text (shapes, offsets, created_ns...)
    replaced by huge, negative or non-numeric values."""
    out = text.decode()
    for _ in range(rng.randint(1, 3)):
        spans = [m.span() for m in NUMBER_RE.finditer(out)]
        a, b = rng.choice(spans)
        out = out[:a] + rng.choice(NUMBERS) + out[b:]
    return _frame(out.encode(), data)


def _set(rng: random.Random, node: Any) -> None:
    """Set, drop or retype one value somewhere under ``node``."""
    while isinstance(node, dict | list) and node:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = rng.choice(keys)
        child = node[key]
        if not isinstance(child, dict | list) or not child or rng.random() < 0.35:
            kind = rng.randrange(4)
            if kind == 0 and isinstance(node, dict):
                del node[key]
            elif kind == 1 and isinstance(child, int) and not isinstance(child, bool):
                node[key] = child + rng.choice([-1, 1, child, -2 * child, 2**40, 2**64])
            else:
                node[key] = rng.choice(VALUES)
            return
        node = child


def _structure(rng: random.Random, text: bytes, data: bytes) -> bytes:
    body = json.loads(text)
    tensors = [name for name in body if name != "__metadata__"]
    meta = body["__metadata__"]
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(9)
        a, b = rng.choice(tensors), rng.choice(tensors)
        if kind == 0:
            _set(rng, body)
        elif (
            kind == 1
            and isinstance(body.get(a), dict)
            and isinstance(body.get(b), dict)
        ):
            field = rng.choice(["data_offsets", "shape", "dtype"])
            if field in body[a] and field in body[b]:
                body[a][field], body[b][field] = body[b][field], body[a][field]
        elif kind == 2 and a in body:
            new = rng.choice([a + "x", "nodot", CHECKSUM_TENSOR, b, "", "a.b.c.k"])
            body[new] = body.pop(a)
        elif kind == 3 and a in body:
            body[a + rng.choice(["2", ".k", ""])] = json.loads(json.dumps(body[a]))
        elif not isinstance(meta, dict):
            continue  # an earlier edit replaced it
        elif kind == 4:
            meta[META_CREATED_NS] = rng.choice(CREATED_NS)
        elif kind == 5:
            meta[META_CREATOR] = rng.choice(CREATORS)
        elif kind == 6:
            keys = meta.get("npukv_keys", "")
            keys = keys if isinstance(keys, str) else ""  # an earlier edit's value
            meta["npukv_keys"] = rng.choice(
                [
                    keys[:-1],
                    keys + "00",
                    keys[:32],
                    "",
                    "zz" * 16,
                    keys.upper(),
                    keys * 2,
                ]
            )
        elif kind == 7:
            meta["npukv_layers"] = rng.choice(LAYER_LISTS)
        elif kind == 8 and rng.random() < 0.01:  # rare: 2 MiB to parse
            meta["npukv_keys"] = TOO_MANY_KEYS
        elif meta:
            meta[rng.choice(list(meta))] = rng.choice(VALUES)
    return _frame(json.dumps(body, separators=(",", ":")).encode(), data)


MUTATORS: list[tuple[Callable[[random.Random, bytes, bytes], bytes], int]] = [
    (_bytes_edit, 30), (_truncate, 5), (_length_prefix, 5), (_text_edit, 15),
    (_number, 20), (_structure, 25),
]  # fmt: skip


def _check(header: ChunkHeader, file_size: int, with_spec: bool) -> None:
    """What a header that parsed must guarantee to its users."""
    assert header.file_size == file_size
    assert header.data_start % DATA_ALIGN == 0
    assert 8 < header.data_start <= file_size
    assert 0 < header.num_blocks <= MAX_CHUNK_BLOCKS
    assert all(len(key) == 16 for key in header.keys)
    assert len(header.layers) == len(header.layer_names) > 0
    assert header.checksums.shape == (header.num_blocks, len(header.layer_names))
    assert header.checksums.size <= MAX_CHECKSUM_CELLS
    cursor = header.data_start
    for layer in header.layers:
        for entry in layer:
            assert entry.begin == cursor
            assert entry.shape[0] == header.num_blocks
            assert entry.row_bytes * header.num_blocks == entry.end - entry.begin
            cursor = entry.end
    assert cursor + header.checksums.nbytes == file_size
    created = header.metadata.get(META_CREATED_NS, "")
    assert len(created) <= MAX_CREATED_NS_DIGITS
    assert int(created or 0) >= 0
    assert len(header.metadata[META_CREATOR]) <= MAX_CREATOR_CHARS
    if with_spec:
        layout = ChunkLayout(SPEC, header.num_blocks, header.data_start)
        assert cursor == layout.checksum_offset


@pytest.mark.timeout(600)
def test_fuzz_the_chunk_header_parser(attack, capsys):
    text, data = _real_chunk()
    rng = random.Random(SEED)
    choices, weights = zip(*MUTATORS, strict=True)
    fd = os.memfd_create("npukv-fuzz")
    outcomes = {"parsed": 0, "FormatError": 0}
    start = time.monotonic()
    try:
        for trial in range(TRIALS):
            mutate = rng.choices(choices, weights)[0]
            blob = mutate(rng, text, data)
            with_spec = rng.random() < 0.5
            os.ftruncate(fd, 0)
            os.pwrite(fd, blob, 0)
            with attack("fuzz: mutated chunk header"):
                try:
                    kw: dict[str, Any] = (
                        {"namespace": NS, "spec": SPEC} if with_spec else {}
                    )
                    header = parse_header(fd, f"trial-{trial}", **kw)
                except FormatError:
                    outcomes["FormatError"] += 1
                    continue
                except Exception as exc:
                    exc.add_note(f"trial {trial} ({mutate.__name__}, seed {SEED:#x})")
                    raise
                _check(header, len(blob), with_spec)
                outcomes["parsed"] += 1
    finally:
        os.close(fd)
    took = time.monotonic() - start
    with capsys.disabled():
        print(f"\nfuzz: {TRIALS} mutated headers in {took:.1f} s: {outcomes}")
    assert sum(outcomes.values()) == TRIALS
    assert outcomes["parsed"] > 0  # the mutations leave some headers valid
