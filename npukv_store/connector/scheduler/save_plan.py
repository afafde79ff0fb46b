"""A step's saves: the blocks of a request that become full in this step.

Runs in: the EngineCore process, on the scheduler's thread.

    SavePlan.full_blocks() - how many leading blocks of a request are full and
                             savable once this step has run
    SavePlan.transfers()   - one save per KV cache group of blocks [start, stop)
    SavePlan.boundary_transfers() - the Mamba states vLLM hands over this step

Prompt blocks are saved, and with ``save_decode`` generated ones too, in the
step that fills them rather than when the request finishes: that needs no step
after the last one (an offline LLM stops stepping when its requests finish).
Sliding-window groups save what a later hit needs (:mod:`npukv_store.connector.groups`).
A Mamba (state) group saves nothing by position: vLLM rewrites, nulls and
relocates the blocks of its table, so a block read by position may hold
another prefix's state. Its states are saved from the exact blocks vLLM hands
over when it caches a boundary (docs/decisions/0065).
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
            saves.append(
                transfer(
                    request.request_id, group.index, ids, rows, keys,
                    tenant=state.tenant, chained=group.kind == "full",
                )
            )  # fmt: skip
        state.saved_any = state.saved_any or bool(saves)
        return saves

    def boundary_transfers(
        self,
        state: RequestState,
        offloads: list[tuple[int, int, int]],
        seen: set[bytes],
    ) -> list[BlockTransfer]:
        """The saves of the Mamba states vLLM hands over for one request this
        step: ``offloads`` is ``[(group_id, block_id, boundary_tokens)]``
        (vLLM's boundary_state_offloads). A state at boundary ``t`` (a whole
        number of blocks) is keyed as block ``t / block_size - 1`` of its
        group's chain: the state belongs to the prefix that ends there. States
        inside a block (a prompt's partial tail), of groups that are not state
        groups, beyond the prompt without ``save_decode``, or ``seen`` in this
        step are left out."""
        request = state.request
        limit = request.num_prompt_tokens
        if self.settings.save_decode:
            limit = len(request.all_token_ids)
        kinds = {group.index: group.kind for group in self.groups}
        rows: dict[int, dict[int, int]] = {}  # group -> block index -> block id
        for group_id, block_id, boundary in offloads:
            if kinds.get(int(group_id)) != "state" or int(block_id) <= 0:
                continue
            boundary = int(boundary)
            if boundary <= 0 or boundary % self.block_size or boundary > limit:
                continue
            rows.setdefault(int(group_id), {})[boundary // self.block_size - 1] = int(
                block_id
            )
        if not rows:
            return []
        keys = self.chains.keys(state, 1 + max(max(r) for r in rows.values()))
        saves = []
        for group_id, by_row in sorted(rows.items()):
            first = keys[0][group_id]
            wanted = sorted(i for i in by_row if first[i] not in seen)
            if not wanted:
                continue
            seen.update(first[i] for i in wanted)
            ids = [0] * (wanted[-1] + 1)
            for i in wanted:
                ids[i] = by_row[i]
            saves.append(
                transfer(
                    request.request_id, group_id, ids, wanted, keys,
                    tenant=state.tenant, chained=False,
                )
            )  # fmt: skip
        state.saved_any = state.saved_any or bool(saves)
        return saves
