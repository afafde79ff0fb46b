"""Chunk files: safetensors files of KV blocks, with per-block per-layer checksums.

Runs in: any process; pure functions plus ``pread`` on a caller's fd. Byte-level
specification: ``docs/format.md``.

    ChunkLayout        - where each layer, part and the checksum table sit
    build_chunk()      - the buffers of a whole chunk file, in file order
    encode_header()    - the 8-byte length + JSON header, padded to 4096 bytes
    compute_checksums()- xxh3_64 per (block, layer) over the layer's parts
    META_*, ChunkHeader, TensorEntry - the metadata keys and a parsed header

Chunk files are untrusted input: :func:`.format_checks.parse_header` reads and
validates a header, raising a :class:`~npukv_store.errors.FormatError`
subclass naming the file and the problem. Data rows are only trusted after
their checksum matches.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from npukv_store import native
from npukv_store.keying import DEFAULT_TENANT
from npukv_store.native import BufferLike
from npukv_store.spec import CHECKSUM_TENSOR, FORMAT_VERSION, NamespaceSpec

#: The data section starts at a multiple of this (O_DIRECT and page alignment).
DATA_ALIGN = 4096
#: Largest header accepted. 64k blocks of 32 hex key chars is 2 MiB; the rest is
#: tensor entries. Bounding it first means a garbled length never allocates.
MAX_HEADER_BYTES = 16 << 20
#: Most blocks in one chunk; keeps headers far below MAX_HEADER_BYTES.
MAX_CHUNK_BLOCKS = 65536
#: Most layers in one chunk (models have ~200 at most): with the next bound,
#: what a header can make a reader allocate.
MAX_CHUNK_LAYERS = 4096
#: Most cells of a checksum table (blocks x layers): 128 MiB of U64, read whole
#: by every header parse, so a header naming more is refused before any read.
MAX_CHECKSUM_CELLS = 1 << 24
#: Most dimensions of a tensor, and the bound of each (a dim is a count of
#: elements of a file far below 2**40 bytes).
MAX_TENSOR_DIMS = 8
MAX_TENSOR_DIM = 1 << 40
#: Digits of a chunk's created_ns (ns since 1970 fits in 19 digits until 2286,
#: and is below 2**64 as the index stores it).
MAX_CREATED_NS_DIGITS = 19
#: Longest creator (``<pid>@<host>``; host names are at most 255 bytes).
MAX_CREATOR_CHARS = 300


#: Keys of a chunk's safetensors ``__metadata__`` (docs/format.md §3).
META_FORMAT = "npukv_format"
META_NAMESPACE = "npukv_namespace"
META_KEYS = "npukv_keys"
META_LAYERS = "npukv_layers"
META_CREATOR = "npukv_creator"
META_CREATED_NS = "npukv_created_ns"
#: optional: the hex tenant digest of the saves that made the chunk (absent:
#: the default tenant; docs/decisions/0067)
META_TENANT = "npukv_tenant"
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


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """A validated chunk header plus its checksum table.

    ``layers[i]`` lists the tensors of layer ``i`` in file order;
    ``checksums[b, i]`` is the xxh3_64 of block ``b``'s bytes of layer ``i``.
    """

    path: str
    file_size: int
    data_start: int
    namespace: str
    keys: tuple[bytes, ...]
    layer_names: tuple[str, ...]
    layers: tuple[tuple[TensorEntry, ...], ...]
    checksums: np.ndarray
    metadata: Mapping[str, str]

    @property
    def num_blocks(self) -> int:
        """Rows (blocks) in the chunk."""
        return len(self.keys)

    def tensor(self, name: str) -> TensorEntry | None:
        """The entry of tensor ``name``, or None."""
        for layer in self.layers:
            for entry in layer:
                if entry.name == name:
                    return entry
        return None


@dataclass(frozen=True, slots=True)
class PartRange:
    """One tensor's bytes in a chunk file's data section."""

    layer_index: int
    name: str  # the tensor name, ``<layer>.<part>``
    dtype: str
    row_shape: tuple[int, ...]
    row_bytes: int
    begin: int  # relative to the data section, as safetensors' data_offsets
    end: int


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Where the bytes of a chunk of ``n_blocks`` blocks of ``spec`` go: the one
    place the header encoder, the saver (which fills a ring image in place) and
    the reader (which checks a file against its namespace) take offsets from.

    The data section is layer-major: layer ``i``'s parts one after another, each
    ``n_blocks`` rows of its ``row_bytes``; then the checksum table, ``U64
    [n_blocks, num_layers]``. ``data_start`` is the header's length (a multiple
    of :data:`DATA_ALIGN`); offsets named ``*_offset`` are from the file start.
    """

    spec: NamespaceSpec
    n_blocks: int
    data_start: int = 0

    def parts(self) -> list[PartRange]:
        """Every tensor of the data section, in file order."""
        out, offset = [], 0
        for index, layer in enumerate(self.spec.layers):
            for part in layer.parts:
                size = self.n_blocks * part.row_bytes
                out.append(
                    PartRange(
                        index,
                        f"{layer.name}.{part.name}",
                        part.dtype,
                        tuple(part.row_shape),
                        part.row_bytes,
                        offset,
                        offset + size,
                    )  # fmt: skip
                )
                offset += size
        return out

    def layer_offset(self, layer_index: int) -> int:
        """File offset of layer ``layer_index``'s first row."""
        before = sum(layer.row_bytes for layer in self.spec.layers[:layer_index])
        return self.data_start + self.n_blocks * before

    @property
    def checksum_offset(self) -> int:
        """File offset of the checksum table: everything before it is data."""
        return self.data_start + self.n_blocks * self.spec.block_bytes

    @property
    def checksum_bytes(self) -> int:
        return self.n_blocks * len(self.spec.layers) * 8

    @property
    def file_size(self) -> int:
        return self.checksum_offset + self.checksum_bytes


def encode_header(
    spec: NamespaceSpec,
    namespace: str,
    keys: Sequence[bytes],
    *,
    creator: str,
    created_ns: int,
    tenant: bytes = DEFAULT_TENANT,
) -> bytes:
    """The header of a chunk of ``keys`` (8-byte length + JSON + space padding).

    The JSON lists the tensors layer by layer in file order, then the checksum
    table; the data section starts at a multiple of :data:`DATA_ALIGN`.
    """
    num_blocks = len(keys)
    if not 0 < num_blocks <= MAX_CHUNK_BLOCKS:
        raise ValueError(f"keys: found {num_blocks}, expected 1..{MAX_CHUNK_BLOCKS}")
    # Never write what parse_header would refuse as corrupt.
    num_layers = len(spec.layers)
    if num_layers > MAX_CHUNK_LAYERS or num_blocks * num_layers > MAX_CHECKSUM_CELLS:
        raise ValueError(
            f"chunk: found {num_blocks} blocks x {num_layers} layers, expected at "
            f"most {MAX_CHUNK_LAYERS} layers and {MAX_CHECKSUM_CELLS} cells"
        )
    if (
        len(creator) > MAX_CREATOR_CHARS
        or not 0 <= created_ns < 10**MAX_CREATED_NS_DIGITS
    ):
        raise ValueError(
            f"creator/created_ns: found {len(creator)} chars/{created_ns}, expected "
            f"at most {MAX_CREATOR_CHARS} chars and 0..{10**MAX_CREATED_NS_DIGITS - 1}"
        )
    body: dict[str, object] = {
        "__metadata__": {
            META_FORMAT: str(FORMAT_VERSION),
            META_NAMESPACE: namespace,
            META_KEYS: b"".join(keys).hex(),
            META_LAYERS: json.dumps([layer.name for layer in spec.layers]),
            META_CREATOR: creator,
            META_CREATED_NS: str(created_ns),
        }
    }
    if tenant != DEFAULT_TENANT:
        body["__metadata__"][META_TENANT] = tenant.hex()  # type: ignore[index]
    layout = ChunkLayout(spec, num_blocks)
    for part in layout.parts():
        body[part.name] = {
            "dtype": part.dtype,
            "shape": [num_blocks, *part.row_shape],
            "data_offsets": [part.begin, part.end],
        }
    table = layout.checksum_offset
    body[CHECKSUM_TENSOR] = {
        "dtype": "U64",
        "shape": [num_blocks, len(spec.layers)],
        "data_offsets": [table, table + layout.checksum_bytes],
    }
    text = json.dumps(body, separators=(",", ":")).encode()
    total = -(-(8 + len(text)) // DATA_ALIGN) * DATA_ALIGN
    return struct.pack("<Q", total - 8) + text + b" " * (total - 8 - len(text))


def compute_checksums(
    spec: NamespaceSpec, rows: Mapping[str, memoryview], num_blocks: int
) -> np.ndarray:
    """``U64 [num_blocks, num_layers]``: xxh3_64 of each block's bytes per layer.

    Args:
        spec: the namespace layout.
        rows: tensor name -> a C-contiguous byte view of ``num_blocks`` rows.
        num_blocks: rows in each view.
    """
    out = np.empty((num_blocks, len(spec.layers)), dtype="<u8")
    for col, layer in enumerate(spec.layers):
        views = [rows[name] for name in layer.tensor_names()]
        out[:, col] = layer_checksums(views, num_blocks)
    return out


def layer_checksums(parts: Sequence[BufferLike], num_blocks: int) -> np.ndarray:
    """xxh3_64 of each block's bytes of one layer, given the layer's part views
    (each ``num_blocks`` rows, in file order)."""
    return native.xxh3_rows(parts, num_blocks)


def build_chunk(
    spec: NamespaceSpec,
    namespace: str,
    keys: Sequence[bytes],
    rows: Mapping[str, memoryview],
    *,
    creator: str,
    created_ns: int,
) -> list[memoryview]:
    """The buffers of a whole chunk file, in file order (no data copied).

    Args:
        rows: every tensor name of ``spec`` -> C-contiguous bytes of its
            ``len(keys)`` rows.
    """
    checksums = compute_checksums(spec, rows, len(keys))
    header = encode_header(
        spec, namespace, keys, creator=creator, created_ns=created_ns
    )
    return [
        memoryview(header),
        *(rows[name] for name in spec.tensor_names()),
        checksums.data.cast("B"),
    ]


__all__ = [
    "META_CREATED_NS",
    "META_CREATOR",
    "META_FORMAT",
    "META_KEYS",
    "META_LAYERS",
    "META_NAMESPACE",
    "MAX_CHECKSUM_CELLS",
    "MAX_CHUNK_BLOCKS",
    "MAX_CHUNK_LAYERS",
    "MAX_CREATED_NS_DIGITS",
    "MAX_CREATOR_CHARS",
    "MAX_HEADER_BYTES",
    "MAX_TENSOR_DIM",
    "MAX_TENSOR_DIMS",
    "REQUIRED_META",
    "ChunkHeader",
    "ChunkLayout",
    "PartRange",
    "TensorEntry",
    "build_chunk",
    "compute_checksums",
    "encode_header",
    "layer_checksums",
]
