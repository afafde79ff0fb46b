"""Test blocks: a tiny namespace, the tensors put() takes for a list of keys,
read() buffers, and the check that a read returned each key's bytes.

A block's bytes are a pure function of its key and tensor name
(:func:`block_tensors`), so any process can tell right bytes from wrong ones
without talking to the writer.

    tiny_spec()      - a small namespace: layers of parts k and v, F16 rows
    block_tensors()  - the put() input for a list of keys (all or some layers)
    empty_blocks()   - zeroed read() buffers for that many blocks
    verify_read()    - the rows read() reported as hits whose bytes are wrong
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from npukv_store import LayerSpec, NamespaceSpec, PartSpec

#: numpy dtypes of the safetensors codes the tests' namespaces use
_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "U8": np.uint8}


def tiny_spec(
    num_layers: int = 3,
    model: str = "tiny-llama",
    *,
    block_size: int = 16,
    row_shape: tuple[int, ...] = (16, 2, 8),
    **kw,
) -> NamespaceSpec:
    """``num_layers`` layers of parts k and v, F16 rows of ``row_shape``: by
    default [16 tokens, 2 heads, 8 dims], 512 B per part per block. ``kw``:
    more NamespaceSpec fields (``extra``)."""
    parts = (PartSpec("k", "F16", row_shape), PartSpec("v", "F16", row_shape))
    layers = tuple(
        LayerSpec(f"model.layers.{i}.attn", parts) for i in range(num_layers)
    )
    return NamespaceSpec(
        model=model, block_size=block_size, kv_dtype="float16", layers=layers, **kw
    )


def _row(key: bytes, name: str, part: PartSpec) -> np.ndarray:
    """Block ``key``'s row of tensor ``name``. SHAKE-128 rather than a seeded
    generator: a generator per row costs about ten times as much, and the
    multi-process scenarios make rows in every step."""
    digest = hashlib.shake_128(key + name.encode()).digest(part.row_bytes)
    raw = np.frombuffer(digest, np.uint8).copy()
    dtype = np.dtype(_NUMPY_DTYPES[part.dtype])
    if dtype.kind == "f":
        # The exponent's top bit cleared: every value is finite, so rows
        # compare equal as floats too (a NaN never equals itself).
        width = 8 * dtype.itemsize
        bits = raw.view(f"<u{dtype.itemsize}")
        bits &= bits.dtype.type((1 << width) - 1 - (1 << (width - 2)))
    return raw.view(dtype).reshape(part.row_shape)


def _tensors(
    spec: NamespaceSpec, layers: Iterable[int] | None
) -> list[tuple[str, PartSpec]]:
    chosen = range(len(spec.layers)) if layers is None else layers
    return [
        (f"{spec.layers[li].name}.{part.name}", part)
        for li in chosen
        for part in spec.layers[li].parts
    ]


def block_tensors(
    spec: NamespaceSpec, keys: Sequence[bytes], layers: Iterable[int] | None = None
) -> dict[str, np.ndarray]:
    """tensor name -> ``[len(keys), *row_shape]`` array of the keys' rows, for
    every layer or for the layer indices ``layers``."""
    return {
        name: np.stack([_row(key, name, part) for key in keys])
        for name, part in _tensors(spec, layers)
    }


def empty_blocks(
    spec: NamespaceSpec, num_keys: int, layers: Iterable[int] | None = None
) -> dict[str, np.ndarray]:
    """Zeroed read() buffers for ``num_keys`` blocks (every layer or
    ``layers``); no key's row is all zeros, so a row read() left alone never
    passes for a hit."""
    return {
        name: np.zeros((num_keys, *part.row_shape), _NUMPY_DTYPES[part.dtype])
        for name, part in _tensors(spec, layers)
    }


def verify_read(
    spec: NamespaceSpec,
    keys: Sequence[bytes],
    out: dict[str, np.ndarray],
    ok: Sequence[bool],
) -> list[str]:
    """One line per row read() called a hit whose bytes are not the key's."""
    parts = dict(_tensors(spec, None))
    problems = []
    for i, hit in enumerate(ok):
        if not hit:
            continue
        for name, array in out.items():
            want = _row(keys[i], name, parts[name]).view(np.uint8).reshape(-1)
            got = np.ascontiguousarray(array[i]).view(np.uint8).reshape(-1)
            if not np.array_equal(got, want):
                problems.append(
                    f"read() returned True for key {keys[i].hex()} but tensor "
                    f"{name} holds wrong bytes"
                )
    return problems
