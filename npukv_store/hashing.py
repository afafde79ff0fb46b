"""Block keys: keyed BLAKE2b-128 chains of token blocks, and namespace
fingerprints.

Runs in: any process; pure functions, thread-safe.

    r     = the chain root: the fingerprint of the namespace's TP-rank-0 form
            (the namespace's own fingerprint at rank 0 and for MLA)
    h[-1] = BLAKE2b-128(key=K, r)
    h[i]  = BLAKE2b-128(key=K, h[i-1] || tokens of block i as int32 LE || extra_i)
    key_i = h[i]                                          where fingerprint == r
          = BLAKE2b-128(key=K, person=RANK_PERSON, fingerprint || h[i])  else

K is the chain key of the process's key domain (npukv_store.keying): without
it a key reveals nothing about its prompt, and nobody can test a guessed
prompt against an index or search for colliding chains offline (the reason
vLLM moved its own prefix hash off unkeyed hashes, GHSA-rm76-4mrf-v9r8).
BLAKE2b is a keyed PRF in the standard library; a 128k-token prompt costs
about 14 ms at 16-token blocks (docs/security.md has the numbers).

Every TP rank of a KV cache group shares one chain (its rank 0's); the other
ranks' keys are a PRF of the chain's links under their own fingerprint
(docs/decisions/0061). So the scheduler hashes a prompt once per group, not
once per rank, and derives a rank's key only where it needs it.

Only full blocks are keyed. The result depends on nothing but the inputs: not on
``PYTHONHASHSEED``, the process or vLLM's own per-process block hashes, so every
process and every restart computes the same keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np
import xxhash

from npukv_store.spec import NamespaceSpec

KEY_BYTES = 16
#: BLAKE2b personalisation of a rank's key: apart from every chain step (no
#: personalisation), so no derived key is ever a chain link
RANK_PERSON = b"npukv-rank-2"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def namespace_fingerprint(spec: NamespaceSpec) -> bytes:
    """The 16-byte fingerprint of a namespace: xxh3_128 of its canonical JSON."""
    return xxhash.xxh3_128_digest(spec.canonical_json().encode())


def chain_root(spec: NamespaceSpec) -> bytes:
    """The fingerprint that seeds the namespace's chain: its TP-rank-0 form's,
    which every rank of the same KV cache group shares."""
    if spec.tp_rank == 0 or spec.rank_independent:
        return namespace_fingerprint(spec)
    return namespace_fingerprint(dataclasses.replace(spec, tp_rank=0))


def _check_key(key: bytes) -> None:
    if not 16 <= len(key) <= 64:
        raise ValueError(f"key: found {len(key)} bytes, expected 16 to 64")


def chain_links(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    root: bytes,
    extra: bytes | Sequence[bytes] = b"",
    parent: bytes | None = None,
    *,
    key: bytes,
) -> list[bytes]:
    """The chain ``h`` of the full token blocks of ``tokens`` from ``root``:
    the keys of the root namespace itself (see :func:`chain_hashes` for the
    arguments; ``parent`` is the link before ``tokens[0]``)."""
    _check_key(key)
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
        seed = keyed.copy()
        seed.update(root)
        prev = seed.digest()
    else:
        prev = parent
    step = block_size * 4
    links: list[bytes] = []
    for i in range(num_blocks):
        block = keyed.copy()  # the keyed state, not the key schedule, per block
        block.update(prev)
        block.update(raw[i * step : (i + 1) * step])
        block.update(extra[i] if per_block else extra)  # type: ignore[arg-type]
        prev = block.digest()
        links.append(prev)
    return links


def rank_keys(
    links: Sequence[bytes], namespace: bytes, root: bytes, *, key: bytes
) -> list[bytes]:
    """The keys of ``namespace`` at ``links`` of the chain rooted at ``root``:
    the links themselves where ``namespace`` is the root, else a keyed PRF of
    each link under the namespace's fingerprint (one BLAKE2b call per key)."""
    _check_key(key)
    if namespace == root:
        return list(links)
    base = hashlib.blake2b(key=key, digest_size=KEY_BYTES, person=RANK_PERSON)
    base.update(namespace)  # 16 bytes, then 16: the input is unambiguous
    copy = base.copy
    out: list[bytes] = []
    for link in links:
        state = copy()
        state.update(link)
        out.append(state.digest())
    return out


def chain_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    namespace: bytes,
    extra: bytes | Sequence[bytes] = b"",
    parent: bytes | None = None,
    *,
    key: bytes,
    root: bytes | None = None,
) -> list[bytes]:
    """Keys of the full token blocks of ``tokens``.

    Args:
        tokens: token ids; a trailing partial block is ignored.
        block_size: tokens per block.
        namespace: the namespace fingerprint (see :func:`namespace_fingerprint`).
        extra: what changes the KV for the same tokens (LoRA id, multimodal
            hashes, cache salt): one bytes for every block, or one per block.
        parent: the chain link of the block before ``tokens[0]`` to continue a
            chain (the key itself where ``namespace`` is the root); ``None``
            starts at the root.
        key: the chain key (:attr:`npukv_store.keying.KeyDomain.chain_key`),
            16 to 64 bytes.
        root: the chain's root (:func:`chain_root` of the namespace's spec);
            ``None``: ``namespace`` is its own root (TP rank 0, MLA).

    Returns:
        One 16-byte key per full block, in order.

    Raises:
        ValueError: block_size < 1, a token outside int32, a per-block
            ``extra`` list shorter than the number of blocks, or a key of
            another length.
    """
    root = namespace if root is None else root
    links = chain_links(tokens, block_size, root, extra, parent, key=key)
    return rank_keys(links, namespace, root, key=key)
