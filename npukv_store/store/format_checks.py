"""Validation rules for chunk headers read from disk (untrusted input).

Runs in: any process, called by :func:`npukv_store.store.format.parse_header`.
Each check raises one :class:`~npukv_store.errors.FormatError` subclass naming the
file, what was found and what was expected (docs/format.md §3).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from npukv_store.errors import (
    BadMagic,
    CorruptChunk,
    NamespaceMismatch,
    VersionMismatch,
)
from npukv_store.spec import CHECKSUM_TENSOR, DTYPE_SIZES, FORMAT_VERSION

if TYPE_CHECKING:  # format imports this module: the layout's type only
    from npukv_store.store.format import ChunkLayout

META_FORMAT = "npukv_format"
META_NAMESPACE = "npukv_namespace"
META_KEYS = "npukv_keys"
META_LAYERS = "npukv_layers"
META_CREATOR = "npukv_creator"
META_CREATED_NS = "npukv_created_ns"
REQUIRED_META = (META_FORMAT, META_NAMESPACE, META_KEYS, META_LAYERS, META_CREATOR)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a chunk; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one block (row) of this tensor."""
        return (self.end - self.begin) // self.shape[0] if self.shape[0] else 0


def check_metadata(meta: object, path: str, namespace: str | None) -> dict[str, str]:
    if not isinstance(meta, dict) or META_FORMAT not in meta:
        raise BadMagic(
            f"{path}: no {META_FORMAT!r} in __metadata__; not an npukv chunk"
        )
    if meta[META_FORMAT] != str(FORMAT_VERSION):
        raise VersionMismatch(
            f"{path}: format version {meta[META_FORMAT]!r}, expected "
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
            f"{path}: namespace {meta[META_NAMESPACE]!r}, expected {namespace!r}"
        )
    return meta


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
        if dtype not in DTYPE_SIZES:
            raise CorruptChunk(f"{path}: tensor {name!r} has dtype {dtype!r}")
        if not (
            isinstance(shape, list)
            and 0 < len(shape) <= 8
            and all(type(d) is int and 0 <= d < 2**40 for d in shape)
        ):
            raise CorruptChunk(f"{path}: tensor {name!r} has shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CorruptChunk(
                f"{path}: tensor {name!r} has data_offsets {offsets!r}, expected "
                f"0 <= begin <= end <= {data_len}"
            )
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * DTYPE_SIZES[dtype] != offsets[1] - offsets[0]:
            raise CorruptChunk(
                f"{path}: tensor {name!r}: {dtype} x {shape} is "
                f"{numel * DTYPE_SIZES[dtype]} bytes, data_offsets span "
                f"{offsets[1] - offsets[0]}"
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
    if len(blob) % 16 or not blob:
        raise CorruptChunk(
            f"{path}: {META_KEYS} holds {len(blob)} bytes, expected 16 per block"
        )
    if not (
        isinstance(layer_names, list)
        and layer_names
        and all(isinstance(n, str) for n in layer_names)
        and len(set(layer_names)) == len(layer_names)
    ):
        raise CorruptChunk(f"{path}: {META_LAYERS} is not a list of distinct names")
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
