"""Byte views of caller arrays: numpy arrays, or CPU torch tensors, without torch.

Runs in: any process. The store layer never imports torch; a torch tensor can
only reach it from a caller that imported torch already, so ``sys.modules`` has it.

    byte_rows()   - a validated, C-contiguous ``uint8 [rows, row_bytes]`` view
    input_rows()  - every tensor of a put, validated against the namespace
    output_rows() - the destination rows of a read, and the layers they pick
    GroupedRows   - one tensor's destination rows spread over several arrays
    merge_reads() - the requests of a read_many as one read
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from npukv_store.spec import NamespaceSpec, PartSpec

# numpy dtype -> safetensors code. numpy has no bf16/fp8: for those the caller
# passes same-width unsigned ints holding the bit patterns.
_NUMPY_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "float16": "F16",
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
}
_BIT_PATTERN_OK = {"BF16": "U16", "F8_E4M3": "U8", "F8_E5M2": "U8"}
_TORCH_CODES = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.int16": "I16",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int32": "I32",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.float64": "F64",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
}


def _as_numpy(array: object, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """The array as numpy, its safetensors dtype code and its logical shape."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        if array.device.type != "cpu":
            raise ValueError(f"{name}: found a {array.device} tensor, expected CPU")
        code = _TORCH_CODES.get(str(array.dtype))
        if code is None:
            raise ValueError(f"{name}: found dtype {array.dtype}, expected a KV dtype")
        if not array.is_contiguous():
            raise ValueError(f"{name}: found a non-contiguous tensor, expected C order")
        # through uint8: numpy cannot hold bf16/fp8 tensors directly.
        raw = array.detach().reshape(-1).view(torch.uint8).numpy()
        return raw, code, tuple(array.shape)
    if not isinstance(array, np.ndarray):
        raise ValueError(
            f"{name}: found {type(array).__name__}, expected a numpy array or a "
            "CPU torch tensor"
        )
    return array, _NUMPY_CODES.get(array.dtype.name, array.dtype.name), array.shape


def empty_rows(part: PartSpec, num_rows: int) -> np.ndarray:
    """A numpy array ``[num_rows, *part.row_shape]`` that :func:`byte_rows`
    accepts for ``part`` (same-width unsigned ints for bf16 and fp8)."""
    code = _BIT_PATTERN_OK.get(part.dtype, part.dtype)
    dtype = next(name for name, c in _NUMPY_CODES.items() if c == code)
    return np.empty((num_rows, *part.row_shape), dtype=dtype)


def byte_rows(
    array: object, part: PartSpec, num_rows: int, name: str, *, writable: bool = False
) -> np.ndarray:
    """``uint8 [num_rows, part.row_bytes]`` view of ``array`` (no copy).

    Raises:
        ValueError: wrong type, dtype, shape, memory order or writability.
    """
    arr, code, shape = _as_numpy(array, name)
    bits_ok = _BIT_PATTERN_OK.get(part.dtype) == code
    if code != part.dtype and not bits_ok:
        raise ValueError(f"{name}: found dtype {code}, expected {part.dtype}")
    if tuple(shape) != (num_rows, *part.row_shape):
        raise ValueError(
            f"{name}: found shape {list(shape)}, expected "
            f"[{num_rows}, {', '.join(map(str, part.row_shape))}]"
        )
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: found a non-contiguous array, expected C order")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name}: found a read-only array, expected a writable one")
    rows = arr.reshape(-1).view(np.uint8)
    if rows.size != num_rows * part.row_bytes:
        raise ValueError(
            f"{name}: found {rows.size} bytes, expected {num_rows} rows of "
            f"{part.row_bytes}"
        )
    return rows.reshape(num_rows, part.row_bytes)


def input_rows(
    spec: NamespaceSpec, keys: Sequence[bytes], tensors: Mapping[str, object]
) -> dict[str, np.ndarray]:
    """Byte rows of every tensor of a put.

    Raises:
        ValueError: keys are not 16 bytes, or tensors do not match ``spec``.
    """
    if not keys or any(not isinstance(k, bytes) or len(k) != 16 for k in keys):
        raise ValueError("keys: expected a non-empty list of 16-byte keys")
    expected = spec.tensor_names()
    if sorted(tensors) != sorted(expected):
        raise ValueError(f"tensors: found {sorted(tensors)}, expected {expected}")
    parts = {f"{lay.name}.{p.name}": p for lay in spec.layers for p in lay.parts}
    return {n: byte_rows(tensors[n], parts[n], len(keys), n) for n in expected}


def output_rows(
    spec: NamespaceSpec, num_rows: int, out: Mapping[str, object]
) -> tuple[list[int], dict[str, np.ndarray]]:
    """The layer indices a read asks for and writable byte rows of each tensor.

    Raises:
        ValueError: a layer's parts are only partly there, or unknown names.
    """
    layers, dest = [], {}
    for li, layer in enumerate(spec.layers):
        names = layer.tensor_names()
        present = [n in out for n in names]
        if any(present) and not all(present):
            raise ValueError(f"out: layer {layer.name!r} needs all of {names}")
        if all(present):
            layers.append(li)
            for name, part in zip(names, layer.parts, strict=True):
                dest[name] = byte_rows(out[name], part, num_rows, name, writable=True)
    if set(out) - set(dest) or not layers:
        raise ValueError(
            f"out: found {sorted(out)}, expected tensor names of model {spec.model!r}"
        )
    return layers, dest


class GroupedRows:
    """One tensor's destination rows when a read fills several arrays (one per
    request of ``KVStore.read_many``), addressed in one row index space. The
    reader only ever slices a run of rows; a run never crosses from one array
    to the next because the index space leaves one unused row between them."""

    def __init__(self, parts: Sequence[tuple[int, np.ndarray]]) -> None:
        self._starts = [start for start, _ in parts]
        self._arrays = [rows for _, rows in parts]

    def __getitem__(self, rows: slice) -> np.ndarray:
        group = bisect_right(self._starts, rows.start) - 1
        if group < 0:
            raise IndexError(f"rows {rows.start}:{rows.stop} before the first array")
        start, array = self._starts[group], self._arrays[group]
        if rows.stop - start > len(array):
            raise IndexError(
                f"rows {rows.start}:{rows.stop} cross the end of array {group} "
                f"(rows {start}:{start + len(array)})"
            )
        return array[rows.start - start : rows.stop - start]


#: What the reader slices rows of: one array, or several (``GroupedRows``).
DestRows = np.ndarray | GroupedRows


@dataclass(frozen=True, slots=True)
class MergedRead:
    """The requests of one ``KVStore.read_many`` call as one read.

    ``keys`` holds every request's keys, one unused ``b""`` between two
    requests (so no run of rows crosses from one request's arrays to the
    next); ``positions`` is the index in ``keys`` of each real key, ``starts``
    each request's first; ``dest`` each tensor's rows over that index space;
    ``layers`` the layers every request names."""

    keys: list[bytes]
    positions: list[int]
    starts: list[int]
    layers: list[int]
    dest: dict[str, DestRows]


def merge_reads(
    spec: NamespaceSpec,
    requests: Sequence[tuple[Sequence[bytes], Mapping[str, object]]],
) -> MergedRead | None:
    """``(keys, out)`` requests as one read; None for no request.

    Raises:
        ValueError: a request names other layers than the first, or its
            ``out`` does not fit (see :func:`output_rows`).
    """
    all_keys: list[bytes] = []
    positions: list[int] = []
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    starts: list[int] = []
    layers: list[int] | None = None
    for keys, out in requests:
        found, rows = output_rows(spec, len(keys), out)
        if layers is not None and found != layers:
            raise ValueError(
                f"read_many: request {len(starts)} names layers {found}, "
                f"expected the first request's {layers}"
            )
        layers = found
        if all_keys:
            all_keys.append(b"")  # one unused row: no run crosses requests
        starts.append(len(all_keys))
        for name, array in rows.items():
            parts.setdefault(name, []).append((len(all_keys), array))
        positions.extend(range(len(all_keys), len(all_keys) + len(keys)))
        all_keys.extend(keys)
    if layers is None:
        return None
    dest: dict[str, DestRows] = {
        name: group[0][1] if len(group) == 1 else GroupedRows(group)
        for name, group in parts.items()
    }
    return MergedRead(all_keys, positions, starts, layers, dest)
