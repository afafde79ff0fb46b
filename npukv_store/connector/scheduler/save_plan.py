"""A step's saves: the blocks of a request that become full in this step.

Runs in: the EngineCore process, on the scheduler's thread.

    SavePlan.full_blocks() - how many leading blocks of a request are full and
                             savable once this step has run
    SavePlan.transfers()   - one save per KV cache group of blocks [start, stop)

Prompt blocks are saved, and with ``save_decode`` generated ones too, in the
step that fills them rather than when the request finishes: that needs no step
after the last one (an offline LLM stops stepping when its requests finish).
Sliding-window groups save what a later hit needs (:mod:`npukv_store.connector.groups`).
"""

from __future__ import annotations

from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.connector.groups import KVGroup, blocks_to_save
from npukv_store.connector.metadata import BlockTransfer
from npukv_store.connector.scheduler.keys import KeyChains, RequestState, transfer


class SavePlan:
    """The save rules of one engine: its KV cache groups, block size and the
    ``save_decode`` and ``sliding_save`` settings."""

    def __init__(
        self,
        groups: tuple[KVGroup, ...],
        block_size: int,
        settings: StoreConfig,
        chains: KeyChains,
    ) -> None:
        self.groups = groups
        self.block_size = block_size
        self.settings = settings
        self.chains = chains

    def full_blocks(self, request: Any, num_tokens: int) -> int:
        """Leading blocks of ``request`` that are full once the step computes
        ``num_tokens`` more of it: prompt blocks, and with save_decode
        generated ones too."""
        limit = request.num_prompt_tokens
        if self.settings.save_decode:  # tokens known now (async scheduling lags)
            limit = len(request.all_token_ids)
        computed_after = request.num_computed_tokens + num_tokens
        full: int = min(computed_after, limit) // self.block_size
        return full

    def transfers(
        self,
        state: RequestState,
        start: int,
        stop: int,
        block_ids: Any,
        seen: set[bytes],
    ) -> list[BlockTransfer]:
        """One save per KV cache group of blocks ``[start, stop)`` into
        ``block_ids`` (one list per group), leaving out null blocks and keys
        ``seen`` in this step's other saves (added to it)."""
        request = state.request
        keys = self.chains.keys(state, stop)
        prompt = request.num_prompt_tokens
        ends = {prompt // self.block_size, (prompt - 1) // self.block_size}
        if state.stored_full > state.hit_blocks:
            ends.add(state.stored_full)  # a junction: later hits stop here too
        if self.settings.save_decode:
            ends.update(range(prompt // self.block_size, stop + 1))
        saves = []
        for group in self.groups:
            ids = block_ids[group.index]
            rows = blocks_to_save(
                group, start, stop, self.block_size,
                tails_only=self.settings.sliding_save == "tails", ends=ends,
            )  # fmt: skip
            first = keys[0][group.index]
            rows = [i for i in rows if ids[i] != 0 and first[i] not in seen]
            if not rows:
                continue
            seen.update(first[i] for i in rows)
            saves.append(transfer(request.request_id, group.index, ids, rows, keys))
        state.saved_any = state.saved_any or bool(saves)
        return saves
