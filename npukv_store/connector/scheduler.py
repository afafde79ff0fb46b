"""The scheduler half of the connector: what to load and what to save.

Runs in: the EngineCore process (one per engine), on the scheduler's thread.

    match()         - longest stored prefix beyond the local prefix-cache hit
    allocated()     - remember the blocks a hit loads into (and, where the
                      workers load layer by layer, hint readahead)
    build_meta()    - one step's loads, saves and released requests
    finished()      - hold the request's blocks until the workers report its
                      saves' copies done

Keys are our own xxh3 chains (DESIGN.md §4), one chain per TP rank namespace;
a block is a hit only when every rank's part is stored. Everything here is
best effort: an exception is logged once and reads as "no hit" / "no save".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata, pack_keys
from npukv_store.connector.namespace import engine_namespaces
from npukv_store.connector.stats import NPUKVStats
from npukv_store.hashing import chain_hashes, namespace_fingerprint
from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    request: Any
    keys: list[list[bytes]]  # per namespace (TP rank), one per full block hashed
    next_mm_index: int = 0
    local_tokens: int = 0  # the block-aligned local hit passed to match()
    stored_blocks: int = 0  # leading blocks the store has (as of match())
    saved_blocks: int = 0  # blocks [0, saved_blocks) are stored, loaded or queued
    saved_any: bool = False
    extras: list[bytes] = field(default_factory=list)


class SchedulerSide:
    """Per-engine scheduling state; see the module docstring."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, settings: StoreConfig
    ) -> None:
        self.settings = settings
        self.specs = engine_namespaces(vllm_config, kv_cache_config, settings)
        self.fingerprints = [namespace_fingerprint(spec) for spec in self.specs]
        self.block_size = self.specs[0].block_size
        # One handle suffices: the index is shared by every namespace, and keys
        # of different namespaces never collide (they are seeded by it).
        self.store = KVStore(settings, self.specs[0])
        self.stats = NPUKVStats()
        self.disabled_reason = ""
        self.kv_cache_manager: Any = None
        self._requests: dict[str, _RequestState] = {}
        self._loads: dict[str, BlockTransfer] = {}
        self._held: list[str] = []
        self._warned: set[str] = set()
        self.hint_readahead = _workers_load_layerwise(vllm_config, settings)

    # -- keys -------------------------------------------------------------------

    def _state(self, request: Any) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None or state.request is not request:
            state = _RequestState(request, [[] for _ in self.specs])
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: _RequestState, num_blocks: int) -> list[list[bytes]]:
        """Each namespace's keys of the first ``num_blocks`` full blocks."""
        have = len(state.keys[0])
        if num_blocks > have:
            bs = self.block_size
            request = state.request
            tokens = list(request.all_token_ids[have * bs : num_blocks * bs])
            extra = self._extras(state, have, num_blocks)
            for chain, fingerprint in zip(state.keys, self.fingerprints, strict=True):
                parent = chain[-1] if chain else None
                chain += chain_hashes(tokens, bs, fingerprint, extra, parent=parent)
        return [chain[:num_blocks] for chain in state.keys]

    def _extras(self, state: _RequestState, start: int, stop: int) -> list[bytes]:
        """Per block: what besides the tokens changes its KV (LoRA, multimodal
        inputs, cache salt, prompt embeddings), as vLLM's prefix cache sees it."""
        request = state.request
        if not (
            request.lora_request
            or request.mm_features
            or request.cache_salt
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return [b""] * (stop - start)
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        bs = self.block_size
        while len(state.extras) < stop:
            index = len(state.extras)
            extra, state.next_mm_index = generate_block_hash_extra_keys(
                request, index * bs, (index + 1) * bs, state.next_mm_index
            )
            state.extras.append(b"" if extra is None else repr(extra).encode())
        return state.extras[start:stop]

    def _lookup(self, keys: list[list[bytes]]) -> int:
        """Leading blocks stored in every namespace."""
        count = len(keys[0])
        for chain in keys:
            count = min(count, self.store.lookup(chain[:count]))
            if count == 0:
                break
        return count

    # -- vLLM's scheduler hooks ---------------------------------------------------

    def match(self, request: Any, num_computed_tokens: int) -> int:
        """External tokens stored beyond ``num_computed_tokens`` (block aligned;
        never the last token, which must be computed to sample)."""
        if self.disabled_reason or request.prompt_token_ids is None:
            return 0
        try:
            state = self._state(request)
            max_blocks = (request.num_tokens - 1) // self.block_size
            state.local_tokens = num_computed_tokens
            if max_blocks * self.block_size <= num_computed_tokens:
                return 0
            stored = self._lookup(self._keys(state, max_blocks))
            state.stored_blocks = stored
            return max(0, stored * self.block_size - num_computed_tokens)
        except Exception:
            self._warn_once("match", "lookup failed; treating as a miss")
            return 0

    def allocated(self, request: Any, block_ids: list[int], num_external: int) -> None:
        """Record the load of ``num_external`` tokens into ``block_ids``."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.saved_blocks = max(state.saved_blocks, state.stored_blocks)
        self.stats.add(lookup_tokens=request.num_prompt_tokens)
        if num_external <= 0:
            return
        bs = self.block_size
        start = state.local_tokens // bs
        stop = start + num_external // bs
        keys = [chain[start:stop] for chain in self._keys(state, stop)]
        self._loads[request.request_id] = BlockTransfer(
            request.request_id,
            list(block_ids[start:stop]),
            [pack_keys(k) for k in keys],
        )
        self.stats.add(hit_tokens=num_external)
        if not self.hint_readahead:
            return
        try:
            for chain in keys:
                self.store.readahead(chain)
        except Exception:
            self._warn_once("readahead", "readahead hint failed")

    def build_meta(self, scheduler_output: Any) -> NPUKVMetadata:
        meta = NPUKVMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        meta.loads = [load for rid, load in self._loads.items() if rid in scheduled]
        self._loads.clear()
        if not self.disabled_reason:
            seen: set[bytes] = set()
            for req_id, num_tokens in scheduled.items():
                save = self._step_save(req_id, num_tokens, seen)
                if save is not None:
                    meta.saves.append(save)
        meta.held_req_ids = self._held
        self._held = []
        return meta

    def _step_save(
        self, req_id: str, num_tokens: int, seen: set[bytes]
    ) -> BlockTransfer | None:
        """The blocks of ``req_id`` that become full this step: prompt blocks,
        and with save_decode generated ones too. Saving them in the step that
        fills them, rather than when the request finishes, needs no step after
        the last one (an offline LLM stops stepping when its requests finish)."""
        state = self._requests.get(req_id)
        if state is None:
            return None
        request = state.request
        limit = request.num_prompt_tokens
        if self.settings.save_decode:  # tokens known now (async scheduling lags)
            limit = len(request.all_token_ids)
        computed_after = request.num_computed_tokens + num_tokens
        full = min(computed_after, limit) // self.block_size
        if full <= state.saved_blocks:
            return None
        try:
            return self._transfer(state, state.saved_blocks, full, seen)
        except Exception:
            self._warn_once("save", "planning a save failed; skipping it")
            return None
        finally:
            state.saved_blocks = full

    def _transfer(
        self, state: _RequestState, start: int, stop: int, seen: set[bytes]
    ) -> BlockTransfer | None:
        (block_ids,) = self.kv_cache_manager.get_block_ids(state.request.request_id)
        keys = [chain[start:stop] for chain in self._keys(state, stop)]
        keep = [i for i, key in enumerate(keys[0]) if key not in seen]
        if not keep:
            return None
        seen.update(keys[0][i] for i in keep)
        state.saved_any = True
        return BlockTransfer(
            state.request.request_id,
            [block_ids[start + i] for i in keep],
            [pack_keys([chain[i] for i in keep]) for chain in keys],
        )

    def finished(self, request: Any) -> bool:
        """True when the request's blocks must stay allocated until the
        workers report it (its saves' device copies may still be running)."""
        state = self._requests.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        if state is None:
            return False
        if state.saved_any:
            self._held.append(request.request_id)
        return state.saved_any

    def disable(self, reason: str) -> None:
        if not self.disabled_reason:
            self.disabled_reason = reason
            logger.warning("npukv_store: stops matching and saving: %s", reason)

    def take_stats(self) -> NPUKVStats | None:
        stats = self.stats
        if stats.is_empty():
            return None
        self.stats = NPUKVStats()
        return stats

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("npukv_store: %s", message, exc_info=True)

    def close(self) -> None:
        self.store.close()


def _workers_load_layerwise(vllm_config: Any, settings: StoreConfig) -> bool:
    """Whether the workers will load layer by layer (``layerwise: on``, or
    ``auto`` on a device; ``auto`` stays bulk on the CPU). The readahead hint
    (DESIGN.md §2) is issued only then. Before one bulk read it costs time:
    a cold 62 MB chunk read streamed took 141 ms after the hint against 90 ms
    without (docs/design.md §19)."""
    if settings.layerwise != "auto":
        return settings.layerwise == "on"
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    return str(device) != "cpu"
