"""The bytes of one block in the remote tier: a self-describing value.

Runs in: any process (pure: numpy, xxhash, the native xxh3 and the spec).

A remote value is one block of one namespace, every layer::

    0   magic       8s   b"NPUKVBLK"
    8   format      u32  VALUE_FORMAT
    12  num_layers  u32  L
    16  data_bytes  u64  the block's bytes over all layers
    24  namespace   16s  the namespace fingerprint
    40  key         16s  the block key
    56  reserved    u64  0
    64  checksums   u64 * L   xxh3_64 of each layer's bytes (a chunk row's)
    64 + 8L   data: layer 0's parts, layer 1's parts, ... (file order)

The checksums are the chunk format's (docs/format.md): xxh3_64 of a block's
bytes of one layer, all its parts in order. A saver copies them from the
checksum table the writer fills, and a reader checks them exactly as it checks
a chunk row. Any mismatch (magic, format, namespace, key, length, a reserved
field that is not 0, a layer's checksum) is a miss. Little-endian throughout.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from npukv_store import native
from npukv_store.spec import NamespaceSpec

VALUE_MAGIC = b"NPUKVBLK"
VALUE_FORMAT = 1
PREFIX = struct.Struct("<8sIIQ16s16sQ")
PREFIX_BYTES = PREFIX.size  # 64
KEY_PREFIX = "npukv"


@dataclass(frozen=True, slots=True)
class ValueLayout:
    """Where a block's pieces sit in its value, for one namespace's layers.

    Args:
        layer_bytes: each layer's bytes of one block (all its parts).
    """

    layer_bytes: tuple[int, ...]

    @classmethod
    def for_spec(cls, spec: NamespaceSpec) -> ValueLayout:
        return cls(tuple(layer.row_bytes for layer in spec.layers))

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def header_bytes(self) -> int:
        return PREFIX_BYTES + 8 * self.num_layers

    @property
    def data_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def value_bytes(self) -> int:
        return self.header_bytes + self.data_bytes

    def layer_offset(self, layer: int) -> int:
        """Offset of layer ``layer``'s bytes within a value."""
        return self.header_bytes + sum(self.layer_bytes[:layer])

    def prefix(self, fingerprint: bytes, key: bytes) -> bytes:
        """The first 64 bytes of the value of ``key``."""
        return PREFIX.pack(
            VALUE_MAGIC, VALUE_FORMAT, self.num_layers, self.data_bytes,
            fingerprint, key, 0,
        )  # fmt: skip


def remote_key(fingerprint: bytes, key: bytes) -> str:
    """The Mooncake key of one block: the namespace, then the block key, so
    that two models sharing a master never meet."""
    return f"{KEY_PREFIX}/{fingerprint.hex()}/{key.hex()}"


def encode_value(
    layout: ValueLayout, fingerprint: bytes, key: bytes, layers: Sequence[bytes]
) -> bytes:
    """A whole value from each layer's bytes (tests, promotion, tools; the
    save path writes the same bytes as pieces, without a copy)."""
    if [len(b) for b in layers] != list(layout.layer_bytes):
        raise ValueError(
            f"layers: found sizes {[len(b) for b in layers]}, expected "
            f"{list(layout.layer_bytes)}"
        )
    sums = struct.pack(
        f"<{len(layers)}Q", *(xxhash.xxh3_64_intdigest(b) for b in layers)
    )
    return layout.prefix(fingerprint, key) + sums + b"".join(layers)


def layer_checksums(layout: ValueLayout, value: np.ndarray) -> list[int]:
    """xxh3_64 of each layer's bytes of ``value``: one native call (GIL
    released) when the layers are of one size, as a model's layers are."""
    data = value[layout.header_bytes :]
    sizes = set(layout.layer_bytes)
    if len(sizes) == 1:
        return [int(x) for x in native.xxh3_rows([data], layout.num_layers)]
    out, offset = [], 0
    for size in layout.layer_bytes:
        out.append(int(native.xxh3_rows([data[offset : offset + size]], 1)[0]))
        offset += size
    return out


def verify_value(
    layout: ValueLayout, fingerprint: bytes, key: bytes, value: np.ndarray
) -> str:
    """Why ``value`` (uint8, exactly ``layout.value_bytes`` long) is not the
    block ``key`` of namespace ``fingerprint``; ``""`` when it is."""
    if value.size != layout.value_bytes:
        return f"{value.size} bytes, expected {layout.value_bytes}"
    raw = value.data
    magic, fmt, layers, data_bytes, found_ns, found_key, reserved = PREFIX.unpack_from(
        raw
    )
    if magic != VALUE_MAGIC:
        return f"magic {magic!r}, expected {VALUE_MAGIC!r}"
    if fmt != VALUE_FORMAT:
        return f"format {fmt}, expected {VALUE_FORMAT}"
    if layers != layout.num_layers or data_bytes != layout.data_bytes:
        return (
            f"{layers} layers of {data_bytes} bytes, expected {layout.num_layers} "
            f"of {layout.data_bytes}"
        )
    if found_ns != fingerprint:
        return f"namespace {found_ns.hex()[:12]}, expected {fingerprint.hex()[:12]}"
    if found_key != key:
        return f"key {found_key.hex()}, expected {key.hex()}"
    if reserved != 0:
        return f"reserved {reserved:#x}, expected 0"
    sums = struct.unpack_from(f"<{layers}Q", raw, PREFIX_BYTES)
    found = layer_checksums(layout, value)
    for index, (expected, got) in enumerate(zip(sums, found, strict=True)):
        if got != expected:
            return f"layer {index} checksum {got:016x}, expected {expected:016x}"
    return ""
