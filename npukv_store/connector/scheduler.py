"""The scheduler half of the connector: what to load and what to save.

Runs in: the EngineCore process (one per engine), on the scheduler's thread.

    match()         - longest stored prefix beyond the local prefix-cache hit,
                      as much of it as the load policy says pays to load
    allocated()     - remember the blocks a hit loads into (and, where the
                      workers load layer by layer, hint readahead)
    build_meta()    - one step's loads, saves and released requests
    finished()      - hold the request's blocks until the workers report its
                      saves' copies done

Keys are our own xxh3 chains (npukv_store.hashing), one chain per namespace: per
TP rank and KV cache group. A block is a hit only when every rank's part is
stored; on a hybrid model a hit must also find, in every sliding-window group,
the blocks its window needs (:mod:`.groups`). Hybrid models load
asynchronously: vLLM can take back a failed load of several KV cache groups
only per request (failed_recving), not per block. Everything here is best
effort: an exception is logged once and reads as "no hit" / "no save".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.connector.groups import blocks_to_save, hit_end
from npukv_store.connector.load_policy import (
    LOAD,
    PROBE,
    RECOMPUTE,
    SHORTER,
    Decision,
    LoadPolicy,
)
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata, pack_keys
from npukv_store.connector.namespace import EngineKV, engine_namespaces
from npukv_store.connector.remote_lookup import RemoteLookup
from npukv_store.connector.stats import SCHEDULER_COUNTERS, NPUKVStats, remote_deltas
from npukv_store.connector.vllm_api import (
    REPORTS_FAILED_LOADS,
    VLLM_VERSION,
    BlockIdTracker,
    ManagerBlockIds,
    lora_identity,
)
from npukv_store.errors import UnsupportedSetup
from npukv_store.hashing import chain_hashes, namespace_fingerprint
from npukv_store.remote.tier import MooncakeTier, open_tier, release_tier
from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)

Keys = list[list[list[bytes]]]  # [rank][group] -> one key per full block


@dataclass(slots=True)
class _RequestState:
    request: Any
    keys: Keys
    next_mm_index: int = 0
    local_tokens: int = 0  # the block-aligned local hit passed to match()
    found_blocks: int = 0  # end of the stored prefix match() found
    hit_blocks: int = 0  # end of the hit it claims (the load policy's part)
    decision: Decision | None = None  # not yet counted in the stats
    stored_full: int = 0  # leading blocks every full-attention group stores
    remote_from: int = 0  # blocks from here to stored_full are remote only
    saved_blocks: int = 0  # blocks [0, saved_blocks) are stored, loaded or queued
    saved_any: bool = False
    counted: bool = False  # its lookup is in the stats
    extras: list[bytes] = field(default_factory=list)


class SchedulerSide:
    """Per-engine scheduling state; see the module docstring."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, settings: StoreConfig
    ) -> None:
        self.settings = settings
        self.stats = NPUKVStats()
        self.policy = LoadPolicy(settings.load_policy, settings.load_margin)
        self.disabled_reason = ""
        #: where a request's block ids are read (vllm_api.block_ids_source),
        #: set by the connector at the first step
        self.block_ids: ManagerBlockIds | BlockIdTracker | None = None
        self._requests: dict[str, _RequestState] = {}
        self._loads: dict[str, list[BlockTransfer]] = {}
        self._failed_loads: list[str] = []
        self._held: list[str] = []
        self._warned: set[str] = set()
        self.store: KVStore | None = None
        self.tier: MooncakeTier | None = None
        self.remote: RemoteLookup | None = None
        self._remote_reported: dict[str, int] = {}
        self._remote_up: bool | None = None
        self.load_async = self.loads_on = self.hint_readahead = False
        try:
            self.engine: EngineKV | None = engine_namespaces(
                vllm_config, kv_cache_config, settings
            )
        except UnsupportedSetup as exc:
            self.engine = None
            self.disable(str(exc), level=logging.ERROR)
            return
        self.fingerprints = [
            [namespace_fingerprint(spec) for spec in rank] for rank in self.engine.specs
        ]
        self.block_size = self.engine.block_size
        # what one worker reads per block: the ranks load their parts at once
        self.block_load_bytes = sum(spec.block_bytes for spec in self.engine.specs[0])
        self.load_async = self.engine.hybrid
        # One handle suffices: the index is shared by every namespace, and keys
        # of different namespaces never collide (they are seeded by it).
        try:
            self.store = KVStore(settings, self.engine.specs[0][0])
        except Exception as exc:  # an unusable cache directory: serve without us
            self.disable(unusable_cache_dir(settings.cache_dir, exc), logging.ERROR)
            return
        self.hint_readahead = _workers_load_layerwise(vllm_config, settings)
        self.loads_on = self._loads_allowed(vllm_config)
        if any(group.kind != "full" for group in self.engine.groups):
            return  # hybrid models: local only (docs/caveats.md)
        self.tier = open_tier(settings)
        if self.tier is not None:
            self.remote = RemoteLookup(self.tier, settings.remote_timeout_ms)

    def _loads_allowed(self, vllm_config: Any) -> bool:
        """vLLM turns prefix caching off where its attention backend cannot
        continue a prefill from reused KV exactly (the CPU platform does it for
        MLA: its prefill and decode paths disagree). A load would then change
        the output, so none is made, unless the user says the backend can.

        A model of several KV cache groups loads asynchronously, and a failed
        load must be reported per request (failed_recving): vLLM < 0.32 has no
        such report and would take the unloaded blocks as loaded, or crash on
        invalid blocks of several groups. There it only saves."""
        assert self.engine is not None
        if self.engine.hybrid and not REPORTS_FAILED_LOADS:
            logger.warning(
                "npukv_store: loads are off, saves go on: this model has %d KV "
                "cache groups, and vLLM %s cannot take a failed load of several "
                "groups back per request (failed_recving, vLLM 0.32+)",
                len(self.engine.groups), VLLM_VERSION,
            )  # fmt: skip
            return False
        if vllm_config.cache_config.enable_prefix_caching:
            return True
        if self.settings.load_without_prefix_caching:
            logger.warning(
                "npukv_store: loading although vLLM runs with prefix caching off "
                "(load_without_prefix_caching: true)"
            )
            return True
        logger.warning(
            "npukv_store: loads are off, saves go on: vLLM runs this model with "
            "prefix caching disabled (cache_config.enable_prefix_caching=False), "
            "so its attention backend may not reuse KV exactly; set "
            "load_without_prefix_caching: true to load anyway"
        )
        return False

    # -- keys -------------------------------------------------------------------

    def _state(self, request: Any) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None or state.request is not request:
            assert self.engine is not None
            keys: Keys = [[[] for _ in rank] for rank in self.engine.specs]
            state = _RequestState(request, keys)
            self._requests[request.request_id] = state
        return state

    def _keys(self, state: _RequestState, num_blocks: int) -> Keys:
        """Each namespace's keys of the first ``num_blocks`` full blocks."""
        have = len(state.keys[0][0])
        if num_blocks > have:
            bs = self.block_size
            request = state.request
            tokens = list(request.all_token_ids[have * bs : num_blocks * bs])
            extra = self._extras(state, have, num_blocks)
            for rank_keys, rank_prints in zip(
                state.keys, self.fingerprints, strict=True
            ):
                for chain, fingerprint in zip(rank_keys, rank_prints, strict=True):
                    parent = chain[-1] if chain else None
                    chain += chain_hashes(tokens, bs, fingerprint, extra, parent=parent)
        return [[chain[:num_blocks] for chain in rank] for rank in state.keys]

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

        # The adapter by name and path on every vLLM (< 0.32 hashes the name
        # only): the store outlives an adapter re-pointed under its name.
        lora = lora_identity(request.lora_request) if request.lora_request else ""
        bs = self.block_size
        while len(state.extras) < stop:
            index = len(state.extras)
            extra, state.next_mm_index = generate_block_hash_extra_keys(
                request, index * bs, (index + 1) * bs, state.next_mm_index
            )
            key = "" if extra is None else repr(extra)
            state.extras.append(f"{lora}{key}".encode())
        return state.extras[start:stop]

    def _hit(self, state: _RequestState, local: int, max_blocks: int) -> int | None:
        """End of the longest hit beyond ``local`` blocks: every full-attention
        group (every rank) stores the prefix, every sliding-window group the
        tail before its end."""
        assert self.engine is not None
        assert self.store is not None
        keys = self._keys(state, max_blocks)
        groups = self.engine.groups
        upper = max_blocks
        for rank_keys in keys:
            for group, chain in zip(groups, rank_keys, strict=True):
                if group.kind == "full" and upper > local:
                    upper = min(upper, self.store.lookup(chain[:upper]))
        state.stored_full = state.remote_from = upper
        sliding = [g for g in groups if g.kind == "sliding"]
        if self.remote is not None and not sliding and upper < max_blocks:
            more = self.remote.extend(
                state.request.request_id,
                [
                    (prints[g.index], rank_keys[g.index][upper:max_blocks])
                    for rank_keys, prints in zip(keys, self.fingerprints, strict=True)
                    for g in groups
                ],
            )
            if more is None:
                return None
            state.stored_full = upper = upper + more
        if upper <= local or not sliding:
            return upper
        present = []
        for group in sliding:
            stored = [True] * (upper - local)
            for rank_keys in keys:
                found = self.store.present(rank_keys[group.index][local:upper])
                stored = [a and b for a, b in zip(stored, found, strict=True)]
            present.append((group, stored))
        return hit_end(local, upper, self.block_size, present)

    # -- vLLM's scheduler hooks ---------------------------------------------------

    def match(self, request: Any, num_computed_tokens: int) -> int | None:
        """External tokens stored beyond ``num_computed_tokens`` (block aligned;
        never the last token, which must be computed to sample). None: the
        remote tier has not answered yet, ask again in the next step."""
        if self.disabled_reason or request.prompt_token_ids is None:
            return 0
        try:
            state = self._state(request)
            state.local_tokens = num_computed_tokens
            state.found_blocks = state.hit_blocks = 0
            state.decision = None
            if not self.loads_on:
                return 0
            max_blocks = (request.num_tokens - 1) // self.block_size
            local = num_computed_tokens // self.block_size
            if max_blocks <= local:
                return 0
            found = self._hit(state, local, max_blocks)
            if found is None:  # the remote tier's answer is not back yet
                return None
            state.found_blocks = state.hit_blocks = found
            if found > local:
                state.decision = self._decide(state, local, found)
                state.hit_blocks = local + state.decision.blocks
            return max(0, state.hit_blocks * self.block_size - num_computed_tokens)
        except Exception:
            self._warn_once("match", "lookup failed; treating as a miss")
            return 0

    def _decide(self, state: _RequestState, local: int, found: int) -> Decision:
        """The load policy's part of the hit ``[local, found)``. A shorter
        prefix is tried only where any prefix of a hit is one: models without
        sliding-window groups (whose windows must end where the hit ends)."""
        assert self.engine is not None
        cached_head = None
        full = [g for g in self.engine.groups if g.kind == "full"]
        if len(full) == len(self.engine.groups):
            chain = state.keys[0][full[0].index]

            def cached_head() -> int:
                assert self.store is not None
                return self.store.cached_prefix(chain[local:found])

        # loads allocated earlier in this scheduling pass: one job with ours
        joins = bool(self._loads)
        return self.policy.decide(
            found - local, self.block_load_bytes, self.block_size, cached_head,
            joins=joins,
        )  # fmt: skip

    def measured(
        self,
        loads: Iterable[Sequence[float]],
        steps: Iterable[Sequence[float]],
    ) -> None:
        """The workers' cost samples of a step, for the load policy."""
        self.policy.observe_loads((float(t), int(c), int(d)) for t, c, d in loads)
        self.policy.observe_steps((float(t), int(n)) for t, n in steps)

    def allocated(
        self, request: Any, block_ids: tuple[list[int], ...], num_external: int
    ) -> None:
        """Record the load of ``num_external`` tokens into ``block_ids`` (one
        list per KV cache group)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        # a declined part of a hit is stored already: recomputed, not saved
        state.saved_blocks = max(state.saved_blocks, state.found_blocks)
        if not state.counted:
            state.counted = True
            self.stats.add(lookup_tokens=request.num_prompt_tokens)
        if state.decision is not None:
            declined = state.found_blocks - state.hit_blocks
            self.stats.add(
                **{_DECIDED[state.decision.kind]: 1},
                declined_tokens=declined * self.block_size,
            )
            state.decision = None
        if num_external <= 0:
            return
        assert self.engine is not None
        assert self.store is not None
        bs = self.block_size
        start = state.local_tokens // bs
        stop = start + num_external // bs
        keys = self._keys(state, stop)
        loads = []
        split = max(start, min(stop, state.remote_from))  # [split, stop): remote
        for group in self.engine.groups:
            ids = block_ids[group.index]
            for part, remote in (
                (range(start, split), False),
                (range(split, stop), True),
            ):
                rows = [i for i in part if ids[i] != 0]  # 0: null block
                if rows:
                    loads.append(
                        _transfer(
                            request.request_id, group.index, ids, rows, keys,
                            asynchronous=self.load_async, remote=remote,
                        )
                    )  # fmt: skip
        if stop > split:
            self.stats.add(remote_hit_tokens=(stop - split) * bs)
        if self.load_async and not loads:  # vLLM waits for it: say it failed
            self.fail_load(request.request_id)
            return
        self._loads[request.request_id] = loads
        self.stats.add(hit_tokens=num_external)
        if not self.hint_readahead:
            return
        try:
            for load in loads:
                for rank in range(len(load.keys_by_rank)):
                    self.store.readahead(load.keys(rank))
        except Exception:
            self._warn_once("readahead", "readahead hint failed")

    def fail_load(self, req_id: str) -> None:
        """An asynchronous load vLLM now waits for could not be planned: the
        workers report it failed in the next step (vLLM recomputes it)."""
        self._loads.pop(req_id, None)
        self._failed_loads.append(req_id)

    def build_meta(self, scheduler_output: Any) -> NPUKVMetadata:
        if self.remote is not None:
            self.remote.new_step()
        if self.block_ids is not None:
            self.block_ids.update(scheduler_output)
        meta = NPUKVMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        meta.num_scheduled_tokens = sum(scheduled.values())
        meta.max_request_tokens = max(scheduled.values(), default=0)
        loads, self._loads = self._loads, {}
        for rid, transfers in loads.items():
            # an asynchronous load runs in a step that does not schedule its
            # request; a synchronous one only in the step that computes it
            if rid in scheduled or (transfers and transfers[0].asynchronous):
                meta.loads += transfers
        meta.failed_loads, self._failed_loads = self._failed_loads, []
        meta.held_req_ids, self._held = self._held, []
        if not self.disabled_reason:  # each request's planning is guarded
            seen: set[bytes] = set()
            for req_id, num_tokens in scheduled.items():
                meta.saves += self._step_save(req_id, num_tokens, seen)
        return meta

    def _step_save(
        self, req_id: str, num_tokens: int, seen: set[bytes]
    ) -> list[BlockTransfer]:
        """The blocks of ``req_id`` that become full this step: prompt blocks,
        and with save_decode generated ones too. Saving them in the step that
        fills them, rather than when the request finishes, needs no step after
        the last one (an offline LLM stops stepping when its requests finish)."""
        state = self._requests.get(req_id)
        if state is None:
            return []
        request = state.request
        limit = request.num_prompt_tokens
        if self.settings.save_decode:  # tokens known now (async scheduling lags)
            limit = len(request.all_token_ids)
        computed_after = request.num_computed_tokens + num_tokens
        full = min(computed_after, limit) // self.block_size
        if full <= state.saved_blocks:
            return []
        try:
            return self._transfers(state, state.saved_blocks, full, seen)
        except Exception:
            self._warn_once("save", "planning a save failed; skipping it")
            return []
        finally:
            state.saved_blocks = full

    def _transfers(
        self, state: _RequestState, start: int, stop: int, seen: set[bytes]
    ) -> list[BlockTransfer]:
        """One save per KV cache group of blocks ``[start, stop)``."""
        assert self.engine is not None
        request = state.request
        assert self.block_ids is not None
        block_ids = self.block_ids.get_block_ids(request.request_id)
        keys = self._keys(state, stop)
        prompt = request.num_prompt_tokens
        ends = {prompt // self.block_size, (prompt - 1) // self.block_size}
        if state.stored_full > state.hit_blocks:
            ends.add(state.stored_full)  # a junction: later hits stop here too
        if self.settings.save_decode:
            ends.update(range(prompt // self.block_size, stop + 1))
        saves = []
        for group in self.engine.groups:
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
            saves.append(_transfer(request.request_id, group.index, ids, rows, keys))
        state.saved_any = state.saved_any or bool(saves)
        return saves

    def finished(self, request: Any) -> bool:
        """True when the request's blocks must stay allocated until the
        workers report it (its saves' device copies may still be running)."""
        state = self._requests.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        if self.block_ids is not None:
            self.block_ids.forget(request.request_id)
        if self.remote is not None:
            self.remote.forget(request.request_id)
        if state is None:
            return False
        if state.saved_any:
            self._held.append(request.request_id)
        return state.saved_any

    def disable(self, reason: str, level: int = logging.WARNING) -> None:
        if not self.disabled_reason:
            self.disabled_reason = reason
            logger.log(
                level, "npukv_store: the connector is off, vLLM serves without "
                "it: %s", reason,
            )  # fmt: skip

    def take_stats(self) -> NPUKVStats | None:
        stats = self.stats
        if self.tier is not None:
            stats.add(
                **remote_deltas(self.tier, SCHEDULER_COUNTERS, self._remote_reported)
            )
            waited = self.remote.take_max_step_s() if self.remote is not None else 0
            if waited > 0:
                stats.peak("remote_wait_seconds", waited)
            if self.tier.up != self._remote_up:  # a gauge: sent when it moves
                self._remote_up = self.tier.up
                stats.data["remote_up"] = int(self.tier.up)
        if stats.is_empty():
            return None
        self.stats = NPUKVStats()
        return stats

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("npukv_store: %s", message, exc_info=True)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.remote is not None:
            self.remote.take_max_step_s()
            logger.info(
                "npukv_store: remote tier: the longest scheduler step spent "
                "%.2f ms on its lookups (remote_timeout_ms %.1f)",
                self.remote.longest_s * 1e3, self.settings.remote_timeout_ms,
            )  # fmt: skip
        if self.tier is not None:
            release_tier(self.tier)


#: decision kind -> its counter in the stats
_DECIDED = {
    LOAD: "decided_load",
    SHORTER: "decided_shorter",
    RECOMPUTE: "decided_recompute",
    PROBE: "decided_probe",
}


def _transfer(
    req_id: str,
    group: int,
    block_ids: list[int],
    rows: list[int],
    keys: Keys,
    *,
    asynchronous: bool = False,
    remote: bool = False,
) -> BlockTransfer:
    """Blocks ``rows`` of one group of a request, with every rank's keys."""
    return BlockTransfer(
        req_id,
        [block_ids[i] for i in rows],
        [pack_keys([rank[group][i] for i in rows]) for rank in keys],
        group=group,
        asynchronous=asynchronous,
        remote=remote,
    )


def unusable_cache_dir(cache_dir: str, exc: BaseException) -> str:
    """One line saying why the store could not be opened in ``cache_dir``
    (read-only, not a directory, foreign files, another format version, ...):
    the connector then turns off and vLLM serves on, as for an unsupported
    setup. Bad configuration values never get here: they stop start-up in
    StoreConfig, before any store is opened."""
    path = os.path.abspath(cache_dir)
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"cache_dir {path}: {exc.strerror}{where}; expected a writable directory"
    found = str(exc).removeprefix("cache_dir: ") or type(exc).__name__
    return f"cache_dir {path}: {found}"


def _workers_load_layerwise(vllm_config: Any, settings: StoreConfig) -> bool:
    """Whether the workers will load layer by layer (``layerwise: on``, or
    ``auto`` on a device; ``auto`` stays bulk on the CPU). The lookup's
    readahead hint for the chunks of a hit is issued only then. Before one
    bulk read it costs time: a cold 62 MB chunk read streamed took 141 ms
    after the hint against 90 ms without (docs/decisions/0051)."""
    if settings.layerwise != "auto":
        return settings.layerwise == "on"
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    return str(device) != "cpu"
