"""KV cache events for KV-aware routers: which blocks this server holds on
NVMe, under vLLM's own block hashes (docs/decisions/0066).

Runs in: the EngineCore process, on the scheduler's thread; vLLM calls
``take_events`` once per step and publishes what it returns with its own
events (``--kv-events-config``).

    KVEvents.saved()   - blocks planned for saving: announced (BlockStored)
                         once the index holds them, never before
    KVEvents.loaded()  - blocks loaded from the store: announced now
    KVEvents.take()    - this step's events: the announcements due, and a
                         BlockRemoved for each announced block that left the
                         directory (evicted or removed by any process: the
                         index's removal log)

A block is announced under vLLM's hash of it (``request.block_hashes``, with
its parent and the extra keys vLLM's own events carry), not under a store key,
so a router matches it with what it computes from the tokens. This server
remembers the blocks it announced (at most MAX_TRACKED: beyond, the oldest is
withdrawn with a BlockRemoved, so a router never keeps a block nobody will
withdraw) and withdraws each one that leaves the directory. If the removal
log moved on past its bound before this server read it, every block it
announced is withdrawn, and announced again when saved or loaded again.
Tracked by rank 0's part of each block (the ranks' parts are saved and
evicted together).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)

#: blocks this server remembers having announced
MAX_TRACKED = 262_144
#: a save is announced at the first step at which the index has it (vLLM
#: asks for events once per step: an idle server announces its last saves
#: with its next step); checked each step, and given up (a full ring dropped
#: it) GIVE_UP_S after its plan
GIVE_UP_S = 60.0


@dataclass(slots=True)
class _Block:
    """One block to announce: vLLM's hash of it and what its event says."""

    key: bytes  # rank 0's store key of the block in its group
    block_hash: Any  # vLLM's ExternalBlockHash
    parent: Any  # the previous block's, None for the first
    token_ids: list[int]
    extra_keys: Any  # vLLM's extra keys of the block (LoRA, salt, mm), or None
    group: int


@dataclass(slots=True)
class _Pending:
    give_up: float
    blocks: list[_Block]
    lora_id: int | None
    lora_name: str | None


class KVEvents:
    """The events of one engine's connector; see the module docstring."""

    def __init__(
        self,
        store: KVStore,
        block_size: int,
        medium: str,
        vllm_events: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``vllm_events``: vLLM's event API (:func:`.vllm_api.kv_event_api`)."""
        self._store, self._bs, self._medium = store, block_size, medium
        self._api = vllm_events
        self._clock = clock
        self._position = store.removed_position()
        self._pending: list[_Pending] = []
        self._tracked: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._out: list[Any] = []
        self._warned = False

    # -- what the scheduler reports ------------------------------------------------

    def saved(
        self, request: Any, group: int, rows: Sequence[int], keys: list[bytes]
    ) -> None:
        """Blocks ``rows`` of ``request`` in ``group``, keyed ``keys`` (rank
        0's), planned for saving this step."""
        blocks = self._blocks(request, group, rows, keys)
        if blocks:
            lora = getattr(request, "lora_request", None)
            self._pending.append(
                _Pending(
                    self._clock() + GIVE_UP_S, blocks,
                    getattr(lora, "adapter_id", None), getattr(lora, "name", None),
                )
            )  # fmt: skip

    def loaded(
        self, request: Any, group: int, rows: Sequence[int], keys: list[bytes]
    ) -> None:
        """Blocks ``rows`` of ``request`` found in the store and loaded."""
        blocks = self._blocks(request, group, rows, keys)
        lora = getattr(request, "lora_request", None)
        self._announce(
            blocks, getattr(lora, "adapter_id", None), getattr(lora, "name", None)
        )

    def take(self) -> list[Any]:
        """The events since the last call."""
        self._announce_due()
        self._withdraw_removed()
        out, self._out = self._out, []
        return out

    # -- inside --------------------------------------------------------------------

    def _blocks(
        self, request: Any, group: int, rows: Sequence[int], keys: list[bytes]
    ) -> list[_Block]:
        """vLLM's view of blocks ``rows``: its hashes are per hash block; a
        block of another size than the hash block is not announced (one line
        once)."""
        hashes = getattr(request, "block_hashes", None) or []
        if rows and len(hashes) < max(rows) + 1:
            return []
        if hashes and len(hashes) != len(request.all_token_ids) // self._bs:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "npukv_store: KV events are off for this engine: vLLM hashes "
                    "blocks of another size than its KV cache blocks (%d tokens)",
                    self._bs,
                )
            return []
        out = []
        for row, key in zip(rows, keys, strict=True):
            start, end = row * self._bs, (row + 1) * self._bs
            out.append(
                _Block(
                    key,
                    self._api.external_hash(hashes[row]),
                    self._api.external_hash(hashes[row - 1]) if row else None,
                    list(request.all_token_ids[start:end]),
                    self._api.extra_keys(request, start, end),
                    group,
                )
            )
        return out

    def _announce_due(self) -> None:
        now = self._clock()
        waiting: list[_Pending] = []
        for pending in self._pending:
            found = self._store.present([b.key for b in pending.blocks])
            ready = [b for b, here in zip(pending.blocks, found, strict=True) if here]
            self._announce(ready, pending.lora_id, pending.lora_name)
            rest = [
                b for b, here in zip(pending.blocks, found, strict=True) if not here
            ]
            if rest and pending.give_up > now:  # the writer may still be at it
                pending.blocks = rest
                waiting.append(pending)
        self._pending = waiting

    def _announce(
        self, blocks: list[_Block], lora_id: int | None, lora_name: str | None
    ) -> None:
        """One BlockStored per run of consecutive blocks of one group."""
        run: list[_Block] = []
        for block in blocks:
            if run and not (
                block.group == run[-1].group and block.parent == run[-1].block_hash
            ):
                self._out.append(self._stored(run, lora_id, lora_name))
                run = []
            run.append(block)
        if run:
            self._out.append(self._stored(run, lora_id, lora_name))
        for block in blocks:
            self._tracked[block.key] = (block.block_hash, block.group)
            self._tracked.move_to_end(block.key)
        while len(self._tracked) > MAX_TRACKED:  # withdrawn: nobody would later
            _, (block_hash, group) = self._tracked.popitem(last=False)
            self._out.append(self._api.removed([block_hash], self._medium, group))

    def _stored(
        self, run: list[_Block], lora_id: int | None, lora_name: str | None
    ) -> Any:
        return self._api.stored(
            block_hashes=[b.block_hash for b in run],
            parent_block_hash=run[0].parent,
            token_ids=[t for b in run for t in b.token_ids],
            block_size=self._bs,
            lora_id=lora_id,
            medium=self._medium,
            lora_name=lora_name,
            extra_keys=[b.extra_keys for b in run],
            group_idx=run[0].group,
        )

    def _withdraw_removed(self) -> None:
        """BlockRemoved for each announced block that left the directory since
        the last read of the removal log (a few of its entries per step)."""
        removed = self._store.removed_since(self._position)
        self._position = removed.position
        if removed.gap:
            logger.info(
                "npukv_store: KV events: the directory's removal log moved on "
                "before this server read it; withdrawing its %d announced blocks",
                len(self._tracked),
            )
            by_group: dict[int, list[Any]] = {}
            for block_hash, group in self._tracked.values():
                by_group.setdefault(group, []).append(block_hash)
            self._tracked.clear()
            for group, hashes in by_group.items():
                self._out.append(self._api.removed(hashes, self._medium, group))
        for key in removed.keys:
            entry = self._tracked.pop(key, None)
            if entry is not None:
                self._out.append(self._api.removed([entry[0]], self._medium, entry[1]))
