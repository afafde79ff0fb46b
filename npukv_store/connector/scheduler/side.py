"""The scheduler half of the connector: what to load and what to save.

Runs in: the EngineCore process (one per engine), on the scheduler's thread.

    match()         - longest stored prefix beyond the local prefix-cache hit,
                      as much of it as the load policy says pays to load
    allocated()     - remember the blocks a hit loads into (and, where the
                      workers load layer by layer, hint readahead)
    build_meta()    - one step's loads, saves and released requests
    finished()      - hold the request's blocks until the workers report its
                      saves' copies done

The key chains live in :mod:`.keys`, the hit search in :mod:`.hits` (its
lookups in :mod:`.lookups`), a step's saves in :mod:`.save_plan`, the choice
to load or recompute in :mod:`.load_policy`. A block is a hit only when every
rank's part is stored; on a hybrid model a hit must also find, in every
sliding-window group, the blocks its window needs, and in every Mamba group
the state at the hit's end (:mod:`npukv_store.connector.groups`). Mamba
states are saved from the blocks vLLM hands over (boundary_state_offloads).
Hybrid models load asynchronously: vLLM can take back a failed load of
several KV cache groups only per request (failed_recving), not per block.
Everything here is best
effort: an exception is logged once and reads as "no hit" / "no save".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.namespace import EngineKV, engine_namespaces
from npukv_store.connector.scheduler.events import KVEvents
from npukv_store.connector.scheduler.hits import find_hit
from npukv_store.connector.scheduler.keys import KeyChains, Keys, RequestState, transfer
from npukv_store.connector.scheduler.load_policy import (
    LOAD,
    PROBE,
    RECOMPUTE,
    SHORTER,
    Decision,
    LoadPolicy,
)
from npukv_store.connector.scheduler.pins import PinApplier
from npukv_store.connector.scheduler.remote_lookup import RemoteLookup
from npukv_store.connector.scheduler.save_plan import SavePlan
from npukv_store.connector.setup import unusable_cache_dir
from npukv_store.connector.stats import SCHEDULER_COUNTERS, NPUKVStats, remote_deltas
from npukv_store.connector.vllm_api import (
    REPORTS_FAILED_LOADS,
    VLLM_VERSION,
    BlockIdTracker,
    KVEventAPI,
    ManagerBlockIds,
    boundary_state_offloads,
    kv_events_enabled,
    start_loads_before_forward,
)
from npukv_store.errors import UnsupportedSetup
from npukv_store.hashing import chain_root, namespace_fingerprint
from npukv_store.remote.tier import MooncakeTier, open_tier, release_tier
from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)


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
        self._requests: dict[str, RequestState] = {}
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
        self.events: KVEvents | None = None
        self.pins: PinApplier | None = None
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
        # one chain per group, rooted at its rank 0 (docs/decisions/0061)
        roots = [chain_root(spec) for spec in self.engine.specs[0]]
        self.chains = KeyChains(self.block_size, self.fingerprints, roots)
        self.save_plan = SavePlan(
            self.engine.groups, self.block_size, settings, self.chains
        )
        # what one worker reads per group's block: the ranks load at once
        self.group_block_bytes = [spec.block_bytes for spec in self.engine.specs[0]]
        self.load_async = self.engine.hybrid
        # One handle suffices: the index is shared by every namespace, and keys
        # of different namespaces never collide (they are seeded by it).
        try:
            self.store = KVStore(settings, self.engine.specs[0][0])
        except Exception as exc:  # an unusable cache directory: serve without us
            self.disable(unusable_cache_dir(settings.cache_dir, exc), logging.ERROR)
            return
        assert self.store.key_domain is not None
        self.chains.chain_key = self.store.key_domain.chain_key
        self.pins = PinApplier(self.store, self.chains)
        if kv_events_enabled(vllm_config):
            self.events = KVEvents(
                self.store, self.block_size, settings.kv_events_medium, KVEventAPI()
            )
        self.hint_readahead = _workers_load_layerwise(vllm_config, settings)
        self.loads_on = self._loads_allowed(vllm_config)
        if not self.engine.full_attention_only:
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

    def _state(self, request: Any) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None or state.request is not request:
            state = self.chains.new_state(request)
            self._requests[request.request_id] = state
            self._first_sight(state)
        return state

    def _first_sight(self, state: RequestState) -> None:
        """A new request's tenant, and the pins it meets (docs/decisions/0067)."""
        assert self.store is not None
        state.tenant = self.store.tenant(state.request.cache_salt)
        if self.pins is None:
            return
        try:
            self.pins.apply(state)
        except Exception:
            self._warn_once("pins", "applying a pin failed; the request is served")

    def _keys(self, state: RequestState, num_blocks: int) -> Keys:
        """Each namespace's keys of the first ``num_blocks`` full blocks."""
        return self.chains.keys(state, num_blocks)

    def _hit(self, state: RequestState, local: int, max_blocks: int) -> int | None:
        """End of the longest hit beyond ``local`` blocks (:mod:`.hits`)."""
        assert self.engine is not None
        assert self.store is not None
        return find_hit(
            state, self.chains, local, max_blocks,
            store=self.store, remote=self.remote, groups=self.engine.groups,
        )  # fmt: skip

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

    def _decide(self, state: RequestState, local: int, found: int) -> Decision:
        """The load policy's part of the hit ``[local, found)``. A shorter
        prefix is tried only where any prefix of a hit is one: models without
        sliding-window groups (whose windows must end where the hit ends)."""
        assert self.engine is not None
        cached_head = None
        full = [g for g in self.engine.groups if g.kind == "full"]
        if len(full) == len(self.engine.groups):
            chain = state.links[full[0].index]  # rank 0's keys

            def cached_head() -> int:  # a retry asks no lookup again
                assert self.store is not None
                head = state.cached_head
                if head is None or head[:2] != (local, found):
                    blocks = self.store.cached_prefix(chain[local:found])
                    head = state.cached_head = (local, found, blocks)
                return head[2]

        # loads allocated earlier in this scheduling pass: one job with ours
        joins = bool(self._loads)
        blocks = found - local
        return self.policy.decide(
            blocks, self._hit_bytes(local, found) // blocks, self.block_size,
            cached_head, joins=joins,
        )  # fmt: skip

    def _hit_bytes(self, local: int, found: int) -> int:
        """What one worker reads for the hit ``[local, found)``: the blocks each
        group loads for it (:meth:`.groups.KVGroup.tail_start`: all of a full
        group's, a window's tail, one state; a state weighs about three KV
        blocks: priced per block, a hybrid's hit would look four times its
        cost)."""
        assert self.engine is not None
        return sum(
            (found - max(local, group.tail_start(found, self.block_size))) * nbytes
            for group, nbytes in zip(
                self.engine.groups, self.group_block_bytes, strict=True
            )
        )

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
        # vLLM asks match() again for this request only if the load fails
        # or the request is preempted: then the store has changed (a failed
        # chunk is quarantined), so that call looks up again. Reusing the
        # answer would plan the same failed load forever.
        state.stored = None
        state.cached_head = None
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
            first = group.tail_start(stop, bs)  # 0 for full attention
            for part, remote in (
                (range(start, split), False),
                (range(split, stop), True),
            ):
                rows = [i for i in part if i >= first and ids[i] != 0]  # 0: null
                if rows:
                    loads.append(
                        transfer(
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
        self._report_events(request, loads, loaded=True)
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
        if any(not t.asynchronous for t in meta.loads):
            start_loads_before_forward(scheduler_output)
        meta.failed_loads, self._failed_loads = self._failed_loads, []
        meta.held_req_ids, self._held = self._held, []
        if not self.disabled_reason:  # each request's planning is guarded
            seen: set[bytes] = set()
            for req_id, num_tokens in scheduled.items():
                meta.saves += self._step_save(req_id, num_tokens, seen)
            for req_id, offloads in boundary_state_offloads(scheduler_output).items():
                meta.saves += self._state_save(req_id, offloads, seen)
        return meta

    def _state_save(
        self, req_id: str, offloads: list[Any], seen: set[bytes]
    ) -> list[BlockTransfer]:
        """The Mamba states vLLM hands over for ``req_id`` this step
        (:meth:`.save_plan.SavePlan.boundary_transfers`)."""
        state = self._requests.get(req_id)
        if state is None:
            return []
        try:
            saves = self.save_plan.boundary_transfers(state, offloads, seen)
            self._report_events(state.request, saves, loaded=False)
            return saves
        except Exception:
            self._warn_once("state-save", "planning a state save failed; skipping it")
            return []

    def _step_save(
        self, req_id: str, num_tokens: int, seen: set[bytes]
    ) -> list[BlockTransfer]:
        """The blocks of ``req_id`` that become full this step (:mod:`.save_plan`)."""
        state = self._requests.get(req_id)
        if state is None:
            return []
        full = self.save_plan.full_blocks(state.request, num_tokens)
        if full <= state.saved_blocks:
            return []
        try:
            assert self.block_ids is not None
            block_ids = self.block_ids.get_block_ids(req_id)
            saves = self.save_plan.transfers(
                state, state.saved_blocks, full, block_ids, seen
            )
            self._report_events(state.request, saves, loaded=False)
            return saves
        except Exception:
            self._warn_once("save", "planning a save failed; skipping it")
            return []
        finally:
            state.saved_blocks = full

    def _report_events(
        self, request: Any, transfers: list[BlockTransfer], *, loaded: bool
    ) -> None:
        """Tell the KV events (if vLLM publishes them) of saved or loaded
        blocks; local blocks only (the remote tier's are not on this node)."""
        if self.events is None:
            return
        try:
            for t in transfers:
                if t.remote:
                    continue
                report = self.events.loaded if loaded else self.events.saved
                report(request, t.group, t.rows, t.keys(0))
        except Exception:
            self._warn_once("events", "KV events failed; events may be missing")

    def take_events(self) -> list[Any]:
        """This step's KV cache events (vLLM publishes them with its own)."""
        if self.events is None or self.disabled_reason:
            return []
        try:
            return self.events.take()
        except Exception:
            self._warn_once("events", "KV events failed; events may be missing")
            return []

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
