"""Reading a chunk header from disk (untrusted input) and checking it.

Runs in: any process; ``pread`` on a caller's fd.

    parse_header() - read and validate a chunk's header and checksum table

``parse_header`` bounds the header length before reading it, checks every
offset and size against the file, checks that the tensors tile the data
section in layer order and that the required metadata is there, and bounds
every number before it is used (counts, dims, offsets, created_ns; JSON
numbers of more than 4300 digits, which int() refuses). Each check
raises one :class:`~npukv_store.errors.FormatError` subclass naming the file,
what was found and what was expected (docs/format.md §3). The format itself
(layout, metadata keys, encoding) is :mod:`.format`, which this module reads
and never the reverse.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping
from typing import TypeGuard

import numpy as np

from npukv_store.errors import (
    BadMagic,
    CorruptChunk,
    NamespaceMismatch,
    VersionMismatch,
)
from npukv_store.spec import (
    CHECKSUM_TENSOR,
    DTYPE_SIZES,
    FORMAT_VERSION,
    NamespaceSpec,
)
from npukv_store.store.format import (
    DATA_ALIGN,
    MAX_CHECKSUM_CELLS,
    MAX_CHUNK_BLOCKS,
    MAX_CHUNK_LAYERS,
    MAX_CREATED_NS_DIGITS,
    MAX_CREATOR_CHARS,
    MAX_HEADER_BYTES,
    MAX_TENSOR_DIM,
    MAX_TENSOR_DIMS,
    META_CREATED_NS,
    META_CREATOR,
    META_FORMAT,
    META_KEYS,
    META_LAYERS,
    META_NAMESPACE,
    REQUIRED_META,
    ChunkHeader,
    ChunkLayout,
    TensorEntry,
)

#: First read of a header: one page-cache-friendly read covers most headers.
_FIRST_READ_BYTES = 64 << 10
#: Characters of a value from the file quoted in a message.
_BRIEF_CHARS = 80


def _brief(value: object) -> str:
    """A short repr of a value from the file, for a message. Never raises:
    a deeply nested list can make repr() itself hit the recursion limit."""
    try:
        text = repr(value)
    except (RecursionError, ValueError, MemoryError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _BRIEF_CHARS else text[: _BRIEF_CHARS - 3] + "..."


def check_metadata(meta: object, path: str, namespace: str | None) -> dict[str, str]:
    if not isinstance(meta, dict) or META_FORMAT not in meta:
        raise BadMagic(
            f"{path}: no {META_FORMAT!r} in __metadata__; not an npukv chunk"
        )
    if meta[META_FORMAT] != str(FORMAT_VERSION):
        raise VersionMismatch(
            f"{path}: format version {_brief(meta[META_FORMAT])}, expected "
            f"{str(FORMAT_VERSION)!r}"
        )
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptChunk(
            f"{path}: __metadata__ lacks {missing} or has non-string values; "
            f"expected string values for {list(REQUIRED_META)}"
        )
    if namespace is not None and meta[META_NAMESPACE] != namespace:
        raise NamespaceMismatch(
            f"{path}: namespace {_brief(meta[META_NAMESPACE])}, expected {namespace!r}"
        )
    # Read as int() and a pid by recovery and the CLI: bounded here, once.
    created = meta.get(META_CREATED_NS, "")
    if created and not (
        len(created) <= MAX_CREATED_NS_DIGITS
        and created.isascii()
        and created.isdigit()
    ):
        raise CorruptChunk(
            f"{path}: {META_CREATED_NS} {_brief(created)}, expected at most "
            f"{MAX_CREATED_NS_DIGITS} decimal digits"
        )
    if len(meta[META_CREATOR]) > MAX_CREATOR_CHARS:
        raise CorruptChunk(
            f"{path}: {META_CREATOR} of {len(meta[META_CREATOR])} chars, expected "
            f"<pid>@<host> of at most {MAX_CREATOR_CHARS}"
        )
    return meta


def _shape_ok(shape: object) -> TypeGuard[list[int]]:
    return (
        isinstance(shape, list)
        and 0 < len(shape) <= MAX_TENSOR_DIMS
        and all(type(d) is int and 0 <= d < MAX_TENSOR_DIM for d in shape)
    )


def check_tensors(
    body: dict[str, object], path: str, data_start: int, file_size: int
) -> list[TensorEntry]:
    entries: list[TensorEntry] = []
    data_len = file_size - data_start
    for name, info in body.items():
        if not isinstance(info, dict):
            raise CorruptChunk(f"{path}: tensor {name!r} is not an object")
        dtype, shape, offsets = (
            info.get("dtype"),
            info.get("shape"),
            info.get("data_offsets"),
        )
        # isinstance first: a list or dict dtype is unhashable in ``in``.
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise CorruptChunk(f"{path}: tensor {name!r} has dtype {_brief(dtype)}")
        if not _shape_ok(shape):
            raise CorruptChunk(f"{path}: tensor {name!r} has shape {_brief(shape)}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CorruptChunk(
                f"{path}: tensor {name!r} has data_offsets {_brief(offsets)}, "
                f"expected 0 <= begin <= end <= {data_len}"
            )
        span = offsets[1] - offsets[0]
        nbytes = DTYPE_SIZES[dtype]
        for dim in shape:
            nbytes = min(nbytes * dim, data_len + 1)  # bounded: never a huge int
        if nbytes != span:
            raise CorruptChunk(
                f"{path}: tensor {name!r}: {dtype} x {shape} is not the "
                f"{span} bytes its data_offsets span"
            )
        entries.append(
            TensorEntry(
                name,
                dtype,
                tuple(shape),
                data_start + offsets[0],
                data_start + offsets[1],
            )
        )
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = data_start
    for entry in entries:
        if entry.begin != cursor:
            raise CorruptChunk(
                f"{path}: tensor {entry.name!r} starts at {entry.begin}, expected "
                f"{cursor} (tensors must tile the data section)"
            )
        cursor = entry.end
    if cursor != file_size:
        raise CorruptChunk(f"{path}: data ends at {cursor}, expected EOF {file_size}")
    return entries


def decode_meta_lists(
    meta: Mapping[str, str], path: str
) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
    try:
        blob = bytes.fromhex(meta[META_KEYS])
        layer_names = json.loads(meta[META_LAYERS])
    except (ValueError, RecursionError):
        raise CorruptChunk(f"{path}: garbled {META_KEYS} or {META_LAYERS}") from None
    if len(blob) % 16 or not 0 < len(blob) <= 16 * MAX_CHUNK_BLOCKS:
        raise CorruptChunk(
            f"{path}: {META_KEYS} holds {len(blob)} bytes, expected 16 per block "
            f"for 1..{MAX_CHUNK_BLOCKS} blocks"
        )
    if not (
        isinstance(layer_names, list)
        and 0 < len(layer_names) <= MAX_CHUNK_LAYERS
        and all(isinstance(n, str) for n in layer_names)
        and len(set(layer_names)) == len(layer_names)
    ):
        raise CorruptChunk(
            f"{path}: {META_LAYERS} is not a list of 1..{MAX_CHUNK_LAYERS} distinct "
            "names"
        )
    if len(blob) // 16 * len(layer_names) > MAX_CHECKSUM_CELLS:
        raise CorruptChunk(
            f"{path}: {len(blob) // 16} blocks x {len(layer_names)} layers, expected "
            f"at most {MAX_CHECKSUM_CELLS} checksums"
        )
    keys = tuple(blob[i : i + 16] for i in range(0, len(blob), 16))
    return keys, tuple(layer_names)


def group_layers(
    entries: list[TensorEntry], layer_names: tuple[str, ...], num_blocks: int, path: str
) -> tuple[tuple[tuple[TensorEntry, ...], ...], TensorEntry]:
    if not entries or entries[-1].name != CHECKSUM_TENSOR:
        raise CorruptChunk(f"{path}: expected {CHECKSUM_TENSOR!r} as the last tensor")
    checksum_entry = entries[-1]
    if checksum_entry.dtype != "U64" or checksum_entry.shape != (
        num_blocks,
        len(layer_names),
    ):
        raise CorruptChunk(
            f"{path}: {CHECKSUM_TENSOR} is {checksum_entry.dtype} "
            f"{list(checksum_entry.shape)}, expected U64 "
            f"[{num_blocks}, {len(layer_names)}]"
        )
    groups: dict[str, list[TensorEntry]] = {name: [] for name in layer_names}
    order: list[str] = []
    for entry in entries[:-1]:
        layer = entry.name.rpartition(".")[0]
        if layer not in groups:
            raise CorruptChunk(f"{path}: tensor {entry.name!r} is in no listed layer")
        if entry.shape[0] != num_blocks:
            raise CorruptChunk(
                f"{path}: tensor {entry.name!r} has {entry.shape[0]} rows, "
                f"expected {num_blocks}"
            )
        if not order or order[-1] != layer:
            order.append(layer)
        groups[layer].append(entry)
    if order != list(layer_names):
        raise CorruptChunk(
            f"{path}: layers appear in file order {order[:4]}..., expected "
            f"{list(layer_names)[:4]}... each contiguous"
        )
    return tuple(tuple(groups[name]) for name in layer_names), checksum_entry


def check_against_spec(
    layers: tuple[tuple[TensorEntry, ...], ...],
    layer_names: tuple[str, ...],
    layout: ChunkLayout,
    path: str,
) -> None:
    """The tensors are exactly those of ``layout`` (a ``format.ChunkLayout``
    of the expected namespace and this chunk's row count), at its offsets."""
    found = [
        (e.name, e.dtype, e.shape[1:], e.begin, e.end)
        for layer in layers
        for e in layer
    ]
    start = layout.data_start
    expected = [
        (p.name, p.dtype, p.row_shape, start + p.begin, start + p.end)
        for p in layout.parts()
    ]
    names = [lay.name for lay in layout.spec.layers]
    if found != expected or list(layer_names) != names:
        raise CorruptChunk(
            f"{path}: tensors {found[:2]}... do not match the namespace layout "
            f"{expected[:2]}..."
        )


def _pread_exact(fd: int, nbytes: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise CorruptChunk(
            f"{path}: short read at offset {offset}: found {len(data)} bytes, "
            f"expected {nbytes}"
        )
    return data


def parse_header(
    fd: int,
    path: str,
    *,
    namespace: str | None = None,
    spec: NamespaceSpec | None = None,
) -> ChunkHeader:
    """Read and validate the header and checksum table of the chunk open on ``fd``.

    Args:
        fd: an fd open for reading on the chunk.
        path: the file's path, for messages.
        namespace: the expected namespace (hex); another one raises.
        spec: the expected layout; tensors must match it exactly.

    Raises:
        BadMagic: not a safetensors file with npukv metadata.
        VersionMismatch: another npukv format version.
        NamespaceMismatch: another namespace than ``namespace``.
        CorruptChunk: any structural problem, short file or layout mismatch.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise BadMagic(f"{path}: not a regular file, expected a chunk file")
    file_size = info.st_size
    if file_size < 8:
        raise BadMagic(f"{path}: found {file_size} bytes, expected a chunk file")
    first = os.pread(fd, min(file_size, _FIRST_READ_BYTES), 0)
    if len(first) < 8:  # cut short since the fstat
        raise CorruptChunk(f"{path}: short read of {len(first)} bytes at offset 0")
    (header_len,) = struct.unpack_from("<Q", first)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise CorruptChunk(
            f"{path}: header length {header_len} does not fit: expected at most "
            f"{min(MAX_HEADER_BYTES, file_size - 8)} bytes"
        )
    raw = first[8 : 8 + header_len]
    if len(raw) < header_len:
        raw += _pread_exact(fd, header_len - len(raw), 8 + len(raw), path)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: not UTF-8, not JSON, or a number of more than 4300
        # digits (int()'s limit: the parse raises instead of building it).
        raise BadMagic(
            f"{path}: header is not JSON ({_brief(str(exc))}); expected a chunk"
        ) from None
    if not isinstance(body, dict):
        raise BadMagic(f"{path}: header is {type(body).__name__}, expected an object")
    meta = check_metadata(body.pop("__metadata__", None), path, namespace)
    data_start = 8 + header_len
    if data_start % DATA_ALIGN:
        raise CorruptChunk(
            f"{path}: data starts at {data_start}, expected a multiple of {DATA_ALIGN}"
        )
    entries = check_tensors(body, path, data_start, file_size)
    keys, layer_names = decode_meta_lists(meta, path)
    layers, checksum_entry = group_layers(entries, layer_names, len(keys), path)
    if spec is not None:
        layout = ChunkLayout(spec, len(keys), data_start)
        check_against_spec(layers, layer_names, layout, path)
    table = _pread_exact(
        fd, checksum_entry.end - checksum_entry.begin, checksum_entry.begin, path
    )
    checksums = np.frombuffer(table, dtype="<u8").reshape(len(keys), len(layer_names))
    return ChunkHeader(
        path=path,
        file_size=file_size,
        data_start=data_start,
        namespace=meta[META_NAMESPACE],
        keys=keys,
        layer_names=layer_names,
        layers=layers,
        checksums=checksums,
        metadata=meta,
    )
