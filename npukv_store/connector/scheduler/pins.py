"""A server's part of pinned prompts: pin the keys of requests that begin
with a prompt the operator pinned (``npukv pin``, docs/decisions/0067).

Runs in: the EngineCore process, on the scheduler's thread, once per new
request.

The operator's CLI knows the prompt's tokens but not this engine's block
keys (they depend on the model, its KV cache groups and TP ranks), so a pin
is recorded as digests of the prompt (store.pins) and every server applies
it to its own keys when it first meets the prompt: the keys of the whole
blocks the request shares with it, in every namespace of the engine, stored
yet or not. Applying costs one index read when the pin holds the keys
already; requests that do not begin with a pinned prompt cost one BLAKE2b
of 64 bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from npukv_store.connector.scheduler.keys import KeyChains, RequestState
from npukv_store.errors import FormatError
from npukv_store.store.pins import (
    PIN_GRANULE,
    PinRecord,
    decode_pins,
    matched_granules,
    pin_digests,
)
from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)

#: how often the pin records are read again (a new pin applies from then on)
REFRESH_S = 1.0


class PinApplier:
    """See the module docstring."""

    def __init__(
        self,
        store: KVStore,
        chains: KeyChains,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert store.key_domain is not None
        self._index = store.index
        self._pin_key = store.key_domain.pin_key
        self._chains = chains
        self._clock = clock
        self._read_at = float("-inf")
        self._by_first: dict[bytes, list[PinRecord]] = {}
        self._bad: set[bytes] = set()

    def refresh(self) -> None:
        """Read the pin records (at most every REFRESH_S); remove expired ones."""
        now = self._clock()
        if now - self._read_at < REFRESH_S:
            return
        self._read_at = now
        wall = time.time_ns()
        by_first: dict[bytes, list[PinRecord]] = {}
        for pin_id, pin in decode_pins(self._index.pin_records()).items():
            if isinstance(pin, FormatError):
                if pin_id not in self._bad:
                    self._bad.add(pin_id)
                    logger.warning("npukv_store: ignoring a pin: %s", pin)
                continue
            if pin.expired(wall):
                if self._index.unpin(pin_id):
                    logger.info(
                        "npukv_store: pin %s (%s) expired; unpinned",
                        pin_id.hex(), pin.label,
                    )  # fmt: skip
                continue
            by_first.setdefault(pin.digests[0], []).append(pin)
        self._by_first = by_first

    def apply(self, state: RequestState) -> int:
        """Pin the keys of ``state``'s request where it begins with a pinned
        prompt; returns the pins applied now."""
        self.refresh()
        request = state.request
        tokens = request.prompt_token_ids
        if not self._by_first or tokens is None or len(tokens) < PIN_GRANULE:
            return 0
        salt = request.cache_salt
        first = pin_digests(self._pin_key, salt, tokens[:PIN_GRANULE])[0]
        pins = self._by_first.get(first)
        if not pins:
            return 0
        longest = max(len(pin.digests) for pin in pins)
        mine = pin_digests(self._pin_key, salt, tokens[: longest * PIN_GRANULE])
        bs = self._chains.block_size
        applied = 0
        for pin in pins:
            blocks = matched_granules(pin.digests, mine) * PIN_GRANULE // bs
            if blocks == 0:
                continue
            keys = self._chains.keys(state, blocks)
            flat = list(
                dict.fromkeys(key for rank in keys for group in rank for key in group)
            )
            if self._index.pin_applied(pin.pin_id, flat[-1]):
                continue  # this engine met the prompt before
            if self._index.pin_keys(pin.pin_id, flat) is not None:
                applied += 1
        return applied
