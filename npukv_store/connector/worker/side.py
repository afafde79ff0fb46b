"""The worker half of the connector: device copies between KV pages and the store.

Runs in: every vLLM Worker process (one per TP rank). The hooks run on the
forward thread; layer reads on the loader's threads; chunk writes on the
store's writer thread. Saves live in :mod:`.save_step`, loads in
:mod:`.loads`; this class registers the KV caches, learns which hooks
fire, and reports.

    register()     - describe each layer's byte runs, open the store (one
                     namespace per KV cache group, one staging ring), register
                     the ring with the device
    save_layer()   - layerwise: this layer's blocks -> the ring (async D2H)
    finish_step()  - bulk saves, hand the batch to the writer, collect load errors
    start_load()   - layerwise: start the loader; bulk: load every layer now;
                     asynchronous loads (hybrid models): start them off the step
    wait_layer()   - the compute stream waits for this layer's H2D copy
    transfer_results() - saves whose copies are done, asynchronous loads done
                     and failed

Modes (``layerwise``): ``on`` saves and loads in the layer hooks; ``off`` does
everything in start_load_kv / wait_for_save; ``auto`` runs as ``off`` until it
has seen both hooks fire for every layer in one step, then as ``on`` (on an
accelerator; on the CPU it stays ``off``, see ``_learn_hooks``). A skipped
load hook turns it ``off`` for good; steps known to skip them load in bulk
and stay layerwise (:mod:`.loads`).
Hooks for layers the store does not hold (vllm-ascend's ``save_kv_layer("",
[])`` for linear attention) are ignored. Mamba (state) layers fire no hooks:
their states are copied in wait_for_save, after the forward wrote them, and
``auto`` learns the hooks from the attention layers alone.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.connector.metadata import NPUKVMetadata
from npukv_store.connector.namespace import (
    PAGE_PART,
    EngineKV,
    engine_namespaces,
    model_order,
)
from npukv_store.connector.setup import unusable_cache_dir
from npukv_store.connector.stats import (
    STORE_COUNTERS,
    WORKER_COUNTERS,
    NPUKVStats,
    remote_deltas,
)
from npukv_store.connector.worker.ascend_rules import SkippedWaits, kernel_block_rows
from npukv_store.connector.worker.costs import CostMeter
from npukv_store.connector.worker.layer_overlap import refuse_shared_layers
from npukv_store.connector.worker.loader import LayerLoader, LoadLayer
from npukv_store.connector.worker.loads import StepLoads
from npukv_store.connector.worker.pages import LayoutError, page_layout
from npukv_store.connector.worker.remote_loads import RemoteLoads
from npukv_store.connector.worker.save_step import StepSaver
from npukv_store.errors import ConfigError, UnsupportedSetup
from npukv_store.io.ring_sizing import RingRequest
from npukv_store.remote.tier import MooncakeTier, open_tier, release_tier
from npukv_store.spec import NamespaceSpec
from npukv_store.store.sizing import (
    DEFAULT_BATCHED_TOKENS,
    ring_request,
    save_batch_target,
)
from npukv_store.store.store import KVStore

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 30.0


class WorkerSide:
    """Per-worker data path; see the module docstring."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, settings: StoreConfig
    ) -> None:
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.layerwise = settings.layerwise == "on"
        self._observe_hooks = settings.layerwise == "auto"
        self.disabled_reason = ""
        self.stores: list[KVStore] = []
        self.backend: Any = None
        self.layers: list[LoadLayer] = []
        self.layer_index: dict[str, int] = {}
        self._layer_pos: list[int] = []  # position of each layer in its group
        self.stats = NPUKVStats()
        self.totals = NPUKVStats()
        self._ring_reported = 0  # the ring occupancy last reported (a gauge)
        self._last_log = time.monotonic()
        self._meta = NPUKVMetadata()
        self.saver: StepSaver | None = None
        self.loader: LayerLoader | None = None
        self.costs: CostMeter | None = None
        self._hooks_seen: set[str] = set()
        #: Mamba groups: no layer hooks, states copied in wait_for_save
        self._state_groups: frozenset[int] = frozenset()
        self._loads_seen: set[str] = set()
        #: a layer hook ran since bind: start_load_kv comes after the forward
        #: (vLLM 0.30+ on a step without synchronous loads, see loads.start)
        self._forward_began = False
        self._warned: set[str] = set()
        self.engine: EngineKV | None = None
        self.remote: MooncakeTier | None = None
        self._remote_reported: dict[str, int] = {}
        # made before the engine is known: a worker that is off still
        # reports its loads as failed
        self.loads = StepLoads(
            SkippedWaits.from_config(vllm_config),
            lambda: self.stats,
            self._warn_once,
            self._load_hook_skipped,
        )
        try:
            self.engine = engine_namespaces(vllm_config, kv_cache_config, settings)
        except UnsupportedSetup as exc:
            # the scheduler says so in the log; serving goes on without us
            self.disabled_reason = str(exc)
            return
        self.rank = 0 if len(self.engine.specs) == 1 else _tp_rank()
        self.specs = self.engine.rank_specs(self.rank)
        self._state_groups = frozenset(
            g.index for g in self.engine.groups if g.kind == "state"
        )
        self._ring_request = _ring_request(vllm_config, self.specs, settings)

    @property
    def store(self) -> KVStore | None:
        """The first group's store handle (the one that owns the ring)."""
        return self.stores[0] if self.stores else None

    # -- registration -------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        if self.engine is None:
            return
        try:
            self._register(kv_caches)
        except _UnusableCacheDir as exc:
            # The scheduler, which opens the same directory, says so in the
            # log; a worker alone failing shows there too, from this reason in
            # the worker metadata (update_connector_output).
            self.disabled_reason = str(exc)
        except (ConfigError, LayoutError) as exc:
            self.disable(str(exc))
        except Exception as exc:
            logger.exception("npukv_store: registration failed")
            self.disable(f"registration failed: {exc!r}")

    def _register(self, kv_caches: dict[str, Any]) -> None:
        from npukv_store.device import get_backend

        device = _first_tensor(kv_caches).device
        self.backend = get_backend(device)
        npu_format = None
        if device.type == "npu":  # NZ private format must be refused
            import torch_npu  # type: ignore[import-not-found]

            npu_format = torch_npu.get_npu_format
        num_blocks = int(self.kv_cache_config.num_blocks)
        rows = kernel_block_rows(
            self.backend.kind, len(self.specs), self.specs[0].block_size
        )
        placed = []
        for group, spec in enumerate(self.specs):
            for pos, layer in enumerate(spec.layers):
                placed.append((layer.name, group, pos, layer.row_bytes))
        placed.sort(key=lambda entry: model_order(entry[0]))  # forward order
        for name, group, pos, row_bytes in placed:
            layout = page_layout(
                name, kv_caches, num_blocks, row_bytes, npu_format, rows_per_block=rows
            )
            self.layer_index[name] = len(self.layers)
            self.layers.append(LoadLayer(f"{name}.{PAGE_PART}", layout, group))
            self._layer_pos.append(pos)
        refuse_shared_layers((layer.group, layer.layout) for layer in self.layers)
        try:
            first = KVStore(self.settings, self.specs[0])
        except Exception as exc:
            raise _UnusableCacheDir(
                unusable_cache_dir(self.settings.cache_dir, exc)
            ) from exc
        self.stores = [first] + [first.sibling(spec) for spec in self.specs[1:]]
        first.prepare_async(self._ring_request)
        ring = first.ring_buffer()
        # save batches the ring can hold twice (a small /dev/shm: smaller chunks)
        batch = save_batch_target(
            self.specs, self.settings.chunk_target_size, ring.nbytes
        )
        saver_settings = dataclasses.replace(self.settings, chunk_target_size=batch)
        self._ring_region = self.backend.register_host(ring.ctypes.data, ring.nbytes)
        self.xfer = self.backend.new_stream()
        self.loader = LayerLoader(
            self.stores, self.layers, self.backend, self.xfer,
            self.settings.prefetch_depth, remote=self._remote_loads(ring),
        )  # fmt: skip
        self.costs = CostMeter(self.backend, self.stores)
        self.loads.attach(
            self.loader, self.costs, self.specs, self.rank, self.backend.kind
        )
        self.saver = StepSaver(
            self.stores, self.specs, self.layers, self._layer_pos, self.backend,
            self.xfer, saver_settings, self.rank, self._warn_once,
            state_groups=self._state_groups,
        )  # fmt: skip
        logger.info(
            "npukv_store: worker rank %d ready: %d layers in %d KV cache group(s), "
            "%s, %d B per block, namespace %s, layerwise=%s, ring registered=%s",
            self.rank, len(self.layers), len(self.specs),
            self.layers[0].layout.kind, sum(s.block_bytes for s in self.specs),
            first.namespace[:12], self.settings.layerwise,
            self._ring_region.registered,
        )  # fmt: skip

    def _remote_loads(self, ring: Any) -> RemoteLoads | None:
        """The remote tier (remote_store: mooncake): the ring's published
        blocks are written to it, and loads read its blocks."""
        if self.engine is not None and not self.engine.full_attention_only:
            # writing a hybrid model's blocks there would only fill the pool
            logger.info("npukv_store: a hybrid model: the remote tier is not used")
            return None
        tier = open_tier(self.settings)
        if tier is None:
            return None
        self.remote = tier
        tier.register(ring.ctypes.data, ring.nbytes)
        self.stores[0].attach_remote(tier)
        placed = [
            (layer.group, self._layer_pos[i], layer.layout)
            for i, layer in enumerate(self.layers)
        ]
        return RemoteLoads(
            tier, self.stores, placed, self.backend, self.xfer,
            self.settings.remote_promote,
        )  # fmt: skip

    def disable(self, reason: str) -> None:
        if not self.disabled_reason:
            self.disabled_reason = reason
            logger.error(
                "npukv_store: the connector is off on this worker, vLLM serves "
                "without it: %s",
                reason,
            )

    # -- per step -------------------------------------------------------------------

    def bind(self, meta: NPUKVMetadata) -> None:
        self._meta = meta
        if self.saver is not None:
            self.saver.plan(meta.saves if not self.disabled_reason else [])
        self._hooks_seen.clear()
        self._loads_seen.clear()
        self._forward_began = False
        self.loads.begin_step()
        if self.costs is not None:
            self.costs.step_started(meta.num_scheduled_tokens, bool(meta.loads))

    def save_layer(self, layer_name: str) -> None:
        self._forward_began = True
        if self._observe_hooks:
            self._hooks_seen.add(layer_name)
        if not self.layerwise or self.saver is None:
            return
        index = self.layer_index.get(layer_name)
        if index is not None:  # else another kind of layer (linear attention's "")
            self.saver.copy_layer(index)

    def finish_step(self) -> None:
        """wait_for_save: copy what the hooks did not, queue the saves, and
        settle this step's loads. Never waits for the disk."""
        if self.costs is not None:
            self.costs.step_ended()
        if self._observe_hooks:
            self._learn_hooks()
        queued = self.saver.finish() if self.saver is not None else None
        if queued is not None:
            blocks, nbytes, seconds = queued
            self.stats.add(
                saved_blocks=blocks, saved_bytes=nbytes, save_seconds=seconds
            )
        self.loads.finish_step()
        self._maybe_log()

    def _learn_hooks(self) -> None:
        """auto: switch to layerwise once both hooks fired for every layer, on
        a device whose copies run beside compute. On the CPU they would share
        the same cores: layerwise only adds a thread hand-off per layer there
        (measured TTFT of a warm 2,000-token hit: about 90 ms layerwise against
        70 ms bulk), so auto stays bulk."""
        # a Mamba layer has no attention hooks: its state is copied in bulk
        names = [
            n
            for n, i in self.layer_index.items()
            if self.layers[i].group not in self._state_groups
        ]
        if not names or not all(
            n in self._hooks_seen and n in self._loads_seen for n in names
        ):
            return
        self._observe_hooks = False
        if self.backend is not None and self.backend.kind == "cpu":
            logger.info("npukv_store: hooks fire; on the CPU layerwise stays off")
            return
        self.layerwise = True
        logger.info("npukv_store: layer hooks fire for every layer: layerwise on")

    def fence(self) -> None:
        """handle_preemptions / held requests: the D2H copies out of blocks
        about to be reused must be complete."""
        if self.saver is not None:
            self.saver.fence()

    def held_requests(self) -> set[str]:
        """Finished requests whose blocks the scheduler holds for us."""
        return set(self._meta.held_req_ids)

    def finished_sending(self) -> set[str] | None:
        held = self.held_requests()
        if not held:
            return None
        self.fence()
        return held

    # -- loads ----------------------------------------------------------------------

    def start_load(self) -> None:
        self.loads.start(
            self._meta,
            layerwise=self.layerwise,
            disabled=bool(self.disabled_reason),
            after_forward=self._forward_began,
        )

    def wait_layer(self, layer_name: str) -> None:
        self._forward_began = True
        if self._observe_hooks:
            self._loads_seen.add(layer_name)
        index = self.layer_index.get(layer_name)
        if index is not None:  # else a layer the store does not hold
            self.loads.wait_layer(index)

    def _load_hook_skipped(self) -> None:
        """A layerwise load's hook was skipped: bulk from now on (0034)."""
        self.layerwise = False

    def take_costs(
        self,
    ) -> tuple[list[tuple[float, int, int]], list[tuple[float, int]]]:
        """The load policy's samples measured since the last call."""
        return self.costs.take() if self.costs is not None else ([], [])

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors()

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving): requests
        whose held blocks are free again, and asynchronous loads that are done
        (a failed one is in both of the last two; vLLM recomputes it)."""
        sending = self.finished_sending() or set()
        recving, failed = self.loads.results()
        return sending, recving, failed

    def abandon_loads(self) -> set[str]:
        """Asynchronous loads still pending, stopped: all failed (StepLoads.abandon)."""
        return self.loads.abandon()

    # -- stats and shutdown ---------------------------------------------------------

    def take_stats(self) -> NPUKVStats | None:
        stats = self.stats
        if self.store is not None:
            counters = self.store.counters.snapshot()
            stats.add(
                **{
                    key: counters.get(key, 0) - self.totals.data[key]
                    for key in STORE_COUNTERS
                }
            )
            if self.remote is not None:
                stats.add(
                    **remote_deltas(self.remote, WORKER_COUNTERS, self._remote_reported)
                )
            ring_used = self.store.ring_used_bytes()
            if ring_used != self._ring_reported:  # a gauge: sent when it moves
                stats.data["ring_used_bytes"] = self._ring_reported = ring_used
        if stats.is_empty():
            return None
        self.totals.aggregate(stats)
        self.stats = NPUKVStats()
        return stats

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < _LOG_INTERVAL_S:
            return
        self._last_log = now
        totals = self.totals.copy().aggregate(self.stats).reduce()
        logger.info(
            "npukv_store rank %d: loaded %d blocks (%.2f GB/s), saved %d blocks, "
            "dropped %d, load errors %d",
            self.rank, totals["loaded_blocks"], totals["load_GBps"],
            totals["saved_blocks"], totals["dropped_blocks"], totals["load_errors"],
        )  # fmt: skip

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self.stores:
            self.fence()  # no device copy uses the ring or the slots any more
        region = getattr(self, "_ring_region", None)
        if region is not None:
            region.close()
        for store in self.stores:
            store.close()  # the first drains the writer, then unlinks the ring
        self.stores = []
        if self.remote is not None:
            release_tier(self.remote)
            self.remote = None

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("npukv_store: %s", message, exc_info=True)


class _UnusableCacheDir(Exception):
    """The store could not be opened in cache_dir (see unusable_cache_dir)."""


def _first_tensor(kv_caches: dict[str, Any]) -> Any:
    for value in kv_caches.values():
        if isinstance(value, list | tuple):
            if value:
                return value[0]
        else:
            return value
    raise ConfigError("register_kv_caches: found no tensors, expected KV caches")


def _ring_request(
    vllm_config: Any, specs: tuple[NamespaceSpec, ...], settings: StoreConfig
) -> RingRequest:
    """An auto ring's size (``ring_size: 0``): two of vLLM's largest steps
    (max_num_batched_tokens) of this worker's blocks, in the share of /dev/shm
    of the engine's workers on this node (store.sizing)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    tokens = (
        getattr(scheduler, "max_num_batched_tokens", None) or DEFAULT_BATCHED_TOKENS
    )
    parallel = vllm_config.parallel_config
    sharers = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "data_parallel_size_local", 1) or 1
    )
    return ring_request(specs, int(tokens), settings.chunk_target_size, sharers)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
