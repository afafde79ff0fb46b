"""Plain-data specs shared by the hashing, store and connector layers.

Runs in: any process; immutable values, no I/O.

A :class:`NamespaceSpec` says everything that makes two KV byte strings
compatible: the model, the KV dtype, the block size, the per-layer layout and the
parallel rank. Its fingerprint (see :mod:`npukv_store.hashing`) names the
directory its chunks live in and seeds every block key, so processes with
different specs share a cache directory without ever seeing each other's blocks.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

#: On-disk format version: the directory marker, chunk metadata and fingerprint
#: all carry it. Bump it on any incompatible change; readers refuse other versions.
#: 2: block keys are keyed with the directory's secret (docs/format.md).
FORMAT_VERSION = 2

#: safetensors dtype codes and their sizes in bytes (the subset KV caches use).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

#: Name of the per-block per-layer checksum tensor inside every chunk.
CHECKSUM_TENSOR = "__npukv_checksums__"

_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/-]{1,200}$")
_PART_RE = re.compile(r"^[A-Za-z0-9_:-]{1,64}$")


def _check_name(what: str, name: str, pattern: re.Pattern[str] = _NAME_RE) -> None:
    if not isinstance(name, str) or not pattern.match(name):
        raise ValueError(
            f"{what} name: found {name!r}, expected characters matching "
            f"{pattern.pattern}"
        )


@dataclass(frozen=True, slots=True)
class PartSpec:
    """One byte run of a layer's block, stored as tensor ``<layer>.<name>``.

    Part names have no dot, so a tensor name splits into layer and part at its
    last dot.

    ``row_shape`` is the logical shape of one block's run (``[]`` is not allowed;
    use ``(nbytes,)`` with dtype ``U8`` when the run has no logical shape).
    """

    name: str
    dtype: str
    row_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_name("part", self.name, _PART_RE)
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"part {self.name!r} dtype: found {self.dtype!r}, expected one of "
                f"{', '.join(DTYPE_SIZES)}"
            )
        shape = tuple(self.row_shape)
        if not shape or any(not isinstance(d, int) or d <= 0 for d in shape):
            raise ValueError(
                f"part {self.name!r} row_shape: found {self.row_shape!r}, "
                "expected a non-empty tuple of positive ints"
            )
        object.__setattr__(self, "row_shape", shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of this part for one block."""
        count = DTYPE_SIZES[self.dtype]
        for dim in self.row_shape:
            count *= dim
        return count


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer: its name and its parts, in file order."""

    name: str
    parts: tuple[PartSpec, ...]

    def __post_init__(self) -> None:
        _check_name("layer", self.name)
        if not self.parts:
            raise ValueError(f"layer {self.name!r}: expected at least one part")
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"layer {self.name!r}: duplicate part names {names}")
        object.__setattr__(self, "parts", tuple(self.parts))

    @property
    def row_bytes(self) -> int:
        """Bytes of this layer for one block (all parts)."""
        return sum(p.row_bytes for p in self.parts)

    def tensor_names(self) -> list[str]:
        """The chunk tensor names of this layer's parts, in file order."""
        return [f"{self.name}.{p.name}" for p in self.parts]


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """Everything that makes KV bytes of one (model, layout, rank) compatible.

    ``rank_independent`` marks MLA latent KV, which is the same on every TP rank:
    the rank then does not enter the fingerprint and the blocks are stored once.
    """

    model: str
    block_size: int
    kv_dtype: str
    layers: tuple[LayerSpec, ...]
    revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    rank_independent: bool = False
    extra: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(
                f"block_size: found {self.block_size!r}, expected tokens > 0"
            )
        if not self.layers:
            raise ValueError("layers: found none, expected at least one layer")
        object.__setattr__(self, "layers", tuple(self.layers))
        names = self.tensor_names()
        if len(set(names)) != len(names):
            raise ValueError(f"layers: duplicate tensor names in {names}")
        if CHECKSUM_TENSOR in names:
            raise ValueError(f"layers: the tensor name {CHECKSUM_TENSOR} is reserved")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(
                f"ranks: found tp {self.tp_rank}/{self.tp_size}, "
                f"pp {self.pp_rank}/{self.pp_size}, expected 0 <= rank < size"
            )

    def tensor_names(self) -> list[str]:
        """All chunk tensor names, layer by layer, in file order."""
        return [name for layer in self.layers for name in layer.tensor_names()]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        return sum(layer.row_bytes for layer in self.layers)

    @classmethod
    def from_json(cls, text: str) -> NamespaceSpec:
        """The spec of a ``namespace.json`` (:meth:`canonical_json`'s output);
        for a rank-independent spec, its rank-0 form (the same fingerprint).

        Raises:
            ValueError: not such a JSON object, or its values are invalid.
        """
        try:
            body = json.loads(text)
            body.pop("format_version")
            layers = tuple(
                LayerSpec(
                    layer["name"],
                    tuple(
                        PartSpec(p["name"], p["dtype"], tuple(p["row_shape"]))
                        for p in layer["parts"]
                    ),
                )
                for layer in body.pop("layers")
            )
            return cls(layers=layers, **body)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"namespace spec: {exc!r}; expected the JSON of a NamespaceSpec"
            ) from None

    def canonical_json(self) -> str:
        """The spec as canonical JSON: the input of the namespace fingerprint."""
        body = asdict(self)
        if self.rank_independent:
            body["tp_rank"] = 0
            body["tp_size"] = 1
        body["format_version"] = FORMAT_VERSION
        return json.dumps(body, sort_keys=True, separators=(",", ":"))
