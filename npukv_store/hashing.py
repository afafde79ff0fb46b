"""Block keys: keyed BLAKE2b-128 chains of token blocks, and namespace
fingerprints.

Runs in: any process; pure functions, thread-safe.

    h[-1] = BLAKE2b-128(key=K, namespace fingerprint)
    h[i]  = BLAKE2b-128(key=K, h[i-1] || tokens of block i as int32 LE || extra_i)

K is the chain key of the process's key domain (npukv_store.keying): without
it a key reveals nothing about its prompt, and nobody can test a guessed
prompt against an index or search for colliding chains offline (the reason
vLLM moved its own prefix hash off unkeyed hashes, GHSA-rm76-4mrf-v9r8).
BLAKE2b is a keyed PRF in the standard library; a 128k-token prompt costs
about 14 ms at 16-token blocks (docs/security.md has the numbers).

Only full blocks are keyed. The result depends on nothing but the inputs: not on
``PYTHONHASHSEED``, the process or vLLM's own per-process block hashes, so every
process and every restart computes the same keys.
"""

from __future__ import annotations

import hashlib
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
    *,
    key: bytes,
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
        key: the chain key (:attr:`npukv_store.keying.KeyDomain.chain_key`),
            16 to 64 bytes.

    Returns:
        One 16-byte key per full block, in order.

    Raises:
        ValueError: block_size < 1, a token outside int32, a per-block
            ``extra`` list shorter than the number of blocks, or a key of
            another length.
    """
    if not 16 <= len(key) <= 64:
        raise ValueError(f"key: found {len(key)} bytes, expected 16 to 64")
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
    keyed = hashlib.blake2b(key=key, digest_size=KEY_BYTES)
    if parent is None:
        root = keyed.copy()
        root.update(namespace)
        prev = root.digest()
    else:
        prev = parent
    step = block_size * 4
    keys: list[bytes] = []
    for i in range(num_blocks):
        block = keyed.copy()  # the keyed state, not the key schedule, per block
        block.update(prev)
        block.update(raw[i * step : (i + 1) * step])
        block.update(extra[i] if per_block else extra)  # type: ignore[arg-type]
        prev = block.digest()
        keys.append(prev)
    return keys
