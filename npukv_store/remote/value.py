"""The bytes of one block in the remote tier: a self-describing, authenticated
value, and the key name it is stored under.

Runs in: any process (pure: hashlib, numpy, xxhash, the native xxh3 and the
spec).

A remote value is one block of one namespace, every layer::

    0   magic       8s   b"NPUKVBLK"
    8   format      u32  VALUE_FORMAT (2)
    12  num_layers  u32  L
    16  data_bytes  u64  the block's bytes over all layers
    24  namespace   16s  the namespace fingerprint
    40  key         16s  the block key
    56  reserved    u64  0
    64  mac         16s  BLAKE2b-128 keyed with the tier's MAC key, over
                         bytes 0..64 then the L checksums
    80  checksums   u64 * L   xxh3_64 of each layer's bytes (a chunk row's)
    80 + 8L   data: layer 0's parts, layer 1's parts, ... (file order)

The checksums are the chunk format's (docs/format.md): xxh3_64 of a block's
bytes of one layer, all its parts in order. A saver copies them from the
checksum table the writer fills, and a reader checks them exactly as it checks
a chunk row. The MAC binds them to the namespace, the key and the lengths
under a secret only the tier's nodes hold (npukv_store.keying): a host on
the Mooncake network can neither forge a value nor move one to another key or
namespace. It covers the checksums, not the data: a keyed hash of every byte
(BLAKE2b, about 0.5 GB/s here) would cost more than the get itself, xxh3
runs at memory speed. Any mismatch (the MAC first, then magic, format,
namespace, key, length, a reserved field that is not 0, a layer's checksum)
is a miss. Little-endian throughout.

The value of a block is stored under :func:`remote_key`, a keyed hash of the
namespace and block key: the names the master lists reveal neither, and a
node without the secret cannot compute the name of any block.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from npukv_store import native
from npukv_store.spec import NamespaceSpec

VALUE_MAGIC = b"NPUKVBLK"
VALUE_FORMAT = 2
PREFIX = struct.Struct("<8sIIQ16s16sQ")
PREFIX_BYTES = PREFIX.size  # 64
MAC_BYTES = 16
#: where the checksums begin: the prefix, then the MAC
SUMS_OFFSET = PREFIX_BYTES + MAC_BYTES  # 80
KEY_PREFIX = "npukv"
NAME_BYTES = 16
#: every reason verify_value gives for a MAC that does not match starts so
MAC_MISMATCH = "MAC mismatch"
# BLAKE2b personalisations: a MAC and a name are never the same function
_MAC_PERSON = b"npukv-value-2"
_NAME_PERSON = b"npukv-name-2"


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
        return SUMS_OFFSET + 8 * self.num_layers

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
        """The first 64 bytes of the value of ``key`` (the MAC follows)."""
        return PREFIX.pack(
            VALUE_MAGIC, VALUE_FORMAT, self.num_layers, self.data_bytes,
            fingerprint, key, 0,
        )  # fmt: skip

    def sign(self, mac_key: bytes, values: np.ndarray) -> None:
        """Write the MAC of every value of ``values`` (uint8 ``[n,
        value_bytes]``, prefix and checksums in place) into it: the save
        path's header piece, completed once the checksums are laid out."""
        base = _mac_base(mac_key)
        sums = slice(SUMS_OFFSET, self.header_bytes)
        for row in values:
            mac = base.copy()
            mac.update(row[:PREFIX_BYTES])
            mac.update(row[sums])
            row[PREFIX_BYTES:SUMS_OFFSET] = np.frombuffer(mac.digest(), np.uint8)


def _mac_base(mac_key: bytes) -> hashlib.blake2b:
    return hashlib.blake2b(key=mac_key, digest_size=MAC_BYTES, person=_MAC_PERSON)


def value_mac(
    mac_key: bytes, prefix: bytes | memoryview, sums: bytes | memoryview
) -> bytes:
    """The MAC of a value whose first 64 bytes are ``prefix`` and whose
    checksums are ``sums``."""
    mac = _mac_base(mac_key)
    mac.update(prefix)
    mac.update(sums)
    return mac.digest()


def remote_key(fingerprint: bytes, key: bytes, name_key: bytes) -> str:
    """The Mooncake key of one block: ``npukv/`` and a keyed hash of its
    namespace and key, so that two models sharing a master never meet and
    the name gives neither away."""
    return remote_keys(fingerprint, (key,), name_key)[0]


def remote_keys(
    fingerprint: bytes, keys: Sequence[bytes], name_key: bytes
) -> list[str]:
    """:func:`remote_key` of each of ``keys`` (the keyed state is made once:
    a lookup names up to a few hundred blocks)."""
    base = hashlib.blake2b(key=name_key, digest_size=NAME_BYTES, person=_NAME_PERSON)
    base.update(fingerprint)  # 16 bytes, then 16: the input is unambiguous
    names = []
    for key in keys:
        name = base.copy()
        name.update(key)
        names.append(f"{KEY_PREFIX}/{name.hexdigest()}")
    return names


def encode_value(
    layout: ValueLayout,
    fingerprint: bytes,
    key: bytes,
    layers: Sequence[bytes],
    *,
    mac_key: bytes,
) -> bytes:
    """A whole value from each layer's bytes (tests, promotion, tools; the
    save path writes the same bytes from its pieces, see ValueLayout.sign)."""
    if [len(b) for b in layers] != list(layout.layer_bytes):
        raise ValueError(
            f"layers: found sizes {[len(b) for b in layers]}, expected "
            f"{list(layout.layer_bytes)}"
        )
    prefix = layout.prefix(fingerprint, key)
    sums = struct.pack(
        f"<{len(layers)}Q", *(xxhash.xxh3_64_intdigest(b) for b in layers)
    )
    return prefix + value_mac(mac_key, prefix, sums) + sums + b"".join(layers)


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
    layout: ValueLayout,
    fingerprint: bytes,
    key: bytes,
    value: np.ndarray,
    *,
    mac_key: bytes,
) -> str:
    """Why ``value`` (uint8, exactly ``layout.value_bytes`` long) is not the
    block ``key`` of namespace ``fingerprint``; ``""`` when it is. A reason
    starting with :data:`MAC_MISMATCH`: not written under ``mac_key``
    (forged, or by a node of another secret)."""
    if value.size != layout.value_bytes:
        return f"{value.size} bytes, expected {layout.value_bytes}"
    raw = value.data
    # the MAC before any field is believed; where the checksums sit comes
    # from the reader's layout, never from the value
    found_mac = bytes(raw[PREFIX_BYTES:SUMS_OFFSET])
    want = value_mac(
        mac_key, raw[:PREFIX_BYTES], raw[SUMS_OFFSET : layout.header_bytes]
    )
    magic, fmt, layers, data_bytes, found_ns, found_key, reserved = PREFIX.unpack_from(
        raw
    )
    if not hmac.compare_digest(found_mac, want):
        if magic == VALUE_MAGIC and fmt != VALUE_FORMAT:  # a hint, not a trust
            return f"{MAC_MISMATCH} (a format {fmt} value, expected {VALUE_FORMAT})"
        return f"{MAC_MISMATCH}: not written with this tier's secret, or damaged"
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
    sums = struct.unpack_from(f"<{layers}Q", raw, SUMS_OFFSET)
    found = layer_checksums(layout, value)
    for index, (expected, got) in enumerate(zip(sums, found, strict=True)):
        if got != expected:
            return f"layer {index} checksum {got:016x}, expected {expected:016x}"
    return ""
