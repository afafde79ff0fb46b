"""Pinned prompts: what ``npukv pin`` records, and how a server tells that a
request begins with a pinned prompt (docs/decisions/0067).

Runs in: any process; pure functions and a dataclass.

A pin names a prompt by digests, never by its tokens: the digest chain of its
token ids in granules of PIN_GRANULE tokens, keyed with the cache's pin key
(npukv_store.keying) and rooted at the tenant's cache salt:

    d[0] = BLAKE2b-128(pin key, person="npukv-pin-1", tag(salt))
    d[i] = BLAKE2b-128(pin key, d[i-1] || tokens of granule i as int32 LE)

The record keeps d[1..n] (:func:`decode_pins` reads the index's records).
A server computes the same chain over a request's first tokens and stops
at the first digest that differs: the request shares the pinned prompt up
to there, and the whole blocks of that prefix are
pinned. A granule of 16 tokens divides every vLLM block size, and a prompt
tokenised alone may differ from the same text inside a longer prompt only at
its tail (tokens merge across the boundary): the prefix before is still
pinned. The block keys themselves depend on the model and rank, which the
operator's CLI does not know; the servers derive them (store.index_pins).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from npukv_store.errors import FormatError

PIN_GRANULE = 16  # tokens per digest: divides every vLLM block size
PIN_PERSON = b"npukv-pin-1"
MAX_PIN_TOKENS = 1 << 20  # a pin's record stays a small meta value
DIGEST = 16


def pin_digests(
    pin_key: bytes, cache_salt: str | None, tokens: Sequence[int] | np.ndarray
) -> list[bytes]:
    """d[1..n] of the whole granules of ``tokens`` (see the module docstring)."""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < -(2**31) or ids.max() >= 2**31)):
        raise ValueError("tokens: expected one dimension of int32 token ids")
    salt = (cache_salt or "").encode()
    prev = hashlib.blake2b(
        len(salt).to_bytes(4, "little") + salt,
        key=pin_key, person=PIN_PERSON, digest_size=DIGEST,
    ).digest()  # fmt: skip
    keyed = hashlib.blake2b(key=pin_key, digest_size=DIGEST)
    count = ids.size // PIN_GRANULE
    raw = ids[: count * PIN_GRANULE].astype("<i4").tobytes()
    step = PIN_GRANULE * 4
    out = []
    for i in range(count):
        state = keyed.copy()
        state.update(prev)
        state.update(raw[i * step : (i + 1) * step])
        prev = state.digest()
        out.append(prev)
    return out


def matched_granules(digests: Sequence[bytes], mine: Sequence[bytes]) -> int:
    """How many leading granules two digest chains share."""
    count = 0
    for theirs, ours in zip(digests, mine, strict=False):
        if theirs != ours:
            break
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class PinRecord:
    """One pin: ``digests`` of its prompt, whose tenant it is, until when."""

    pin_id: bytes  # 8 random bytes
    digests: tuple[bytes, ...]
    tenant: bytes
    label: str = ""
    created_ns: int = 0
    expires_ns: int = 0  # 0: never

    @classmethod
    def new(
        cls,
        digests: Sequence[bytes],
        tenant: bytes,
        *,
        label: str = "",
        ttl_s: float | None = None,
    ) -> PinRecord:
        now = time.time_ns()
        expires = 0 if ttl_s is None else now + int(ttl_s * 1e9)
        return cls(os.urandom(8), tuple(digests), tenant, label, now, expires)

    @property
    def tokens(self) -> int:
        return len(self.digests) * PIN_GRANULE

    def expired(self, now_ns: int) -> bool:
        return 0 < self.expires_ns <= now_ns

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "label": self.label,
                "tenant": self.tenant.hex(),
                "created_ns": self.created_ns,
                "expires_ns": self.expires_ns,
                "digests": b"".join(self.digests).hex(),
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, pin_id: bytes, raw: bytes) -> PinRecord:
        """Raises FormatError naming what is wrong with a stored record."""
        try:
            body = json.loads(raw)
            blob = bytes.fromhex(body["digests"])
            tenant = bytes.fromhex(body["tenant"])
            record = cls(
                pin_id,
                tuple(blob[i : i + DIGEST] for i in range(0, len(blob), DIGEST)),
                tenant,
                str(body.get("label", "")),
                int(body.get("created_ns", 0)),
                int(body.get("expires_ns", 0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(
                f"pin {pin_id.hex()}: unreadable record ({exc}); expected the "
                "JSON npukv pin writes"
            ) from None
        if len(blob) % DIGEST or not blob or len(tenant) != 8 or len(pin_id) != 8:
            raise FormatError(
                f"pin {pin_id.hex()}: found {len(blob)} digest bytes and a "
                f"{len(tenant)}-byte tenant, expected a multiple of {DIGEST} "
                "and 8"
            )
        return record


def decode_pins(raw: Mapping[bytes, bytes]) -> dict[bytes, PinRecord | FormatError]:
    """The index's pin records (``Index.pin_records``) decoded: each pin id to
    its record, or to the one-line error of a record that cannot be read."""
    decoded: dict[bytes, PinRecord | FormatError] = {}
    for pin_id, value in raw.items():
        try:
            decoded[pin_id] = PinRecord.from_json(pin_id, value)
        except FormatError as exc:
            decoded[pin_id] = exc
    return decoded
