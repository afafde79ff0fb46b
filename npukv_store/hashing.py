"""Block keys: xxh3-128 chain hashes of token blocks, and namespace fingerprints.

Runs in: any process; pure functions, thread-safe.

    h[-1] = xxh3_128(namespace fingerprint)
    h[i]  = xxh3_128(h[i-1] || tokens of block i as int32 LE || extra_i)

Only full blocks are keyed. The result depends on nothing but the inputs: not on
``PYTHONHASHSEED``, the process or vLLM's own per-process block hashes, so every
process and every restart computes the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from npukv_store.spec import NamespaceSpec

KEY_BYTES = 16
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def namespace_fingerprint(spec: NamespaceSpec) -> bytes:
    """The 16-byte fingerprint of a namespace: xxh3_128 of its canonical JSON."""
    return xxhash.xxh3_128_digest(spec.canonical_json().encode())


def chain_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    namespace: bytes,
    extra: bytes | Sequence[bytes] = b"",
    parent: bytes | None = None,
) -> list[bytes]:
    """Keys of the full token blocks of ``tokens``.

    Args:
        tokens: token ids; a trailing partial block is ignored.
        block_size: tokens per block.
        namespace: the namespace fingerprint (see :func:`namespace_fingerprint`).
        extra: what changes the KV for the same tokens (LoRA id, multimodal
            hashes, cache salt): one bytes for every block, or one per block.
        parent: the key of the block before ``tokens[0]`` to continue a chain;
            ``None`` starts at the namespace root.

    Returns:
        One 16-byte key per full block, in order.

    Raises:
        ValueError: block_size < 1, a token outside int32, or a per-block
            ``extra`` list shorter than the number of blocks.
    """
    if block_size < 1:
        raise ValueError(f"block_size: found {block_size}, expected >= 1")
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"tokens: found shape {ids.shape}, expected one dimension")
    if ids.size and (ids.min() < _INT32_MIN or ids.max() > _INT32_MAX):
        raise ValueError("tokens: found a value outside int32, expected token ids")
    num_blocks = ids.size // block_size
    raw = ids[: num_blocks * block_size].astype("<i4").tobytes()
    per_block = not isinstance(extra, bytes | bytearray)
    if per_block and len(extra) < num_blocks:
        raise ValueError(
            f"extra: found {len(extra)} entries, expected one per block ({num_blocks})"
        )
    prev = xxhash.xxh3_128_digest(namespace) if parent is None else parent
    step = block_size * 4
    keys: list[bytes] = []
    for i in range(num_blocks):
        block_extra = extra[i] if per_block else extra
        prev = xxhash.xxh3_128_digest(
            b"".join((prev, raw[i * step : (i + 1) * step], block_extra))  # type: ignore[arg-type]
        )
        keys.append(prev)
    return keys
