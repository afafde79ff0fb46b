"""Every difference between the vLLM versions the connector runs on, in one place.

Runs in: every process that imports the connector (EngineCore, each Worker, the
API server's stats logger). Chosen once, at import, from what the installed
vLLM has (feature tests; the version string only bounds the tested range). The
rest of the connector calls these names and never asks which vLLM it runs on.

Supported: vLLM 0.23 (vllm-ascend 0.23.0.post1) to 0.34, vLLM 0.30 being
vllm-ascend 0.30.0rc2's. The differences (docs/vllm.md §3 has them with file
and line):

    TransferResults        vLLM's KVConnectorTransferResults (0.30+), else a
                           twin: vLLM 0.23 only calls get_finished
    REPORTS_FAILED_LOADS   vLLM takes a failed asynchronous load back per
                           request (failed_recving, 0.30+); without it a model
                           of several KV cache groups does not load (saves go
                           on). Where it has it, every failed load of such a
                           model goes there, never to
                           get_block_ids_with_load_errors: vLLM 0.32+ raises
                           RuntimeError on a block error of several groups
    kv_cache_layout()      KVCacheConfig.kv_cache_layout (0.30+), else ""
    HANDS_OFF_BOUNDARY_STATES  the scheduler hands a connector the exact
                           blocks of Mamba align-mode states
                           (SchedulerOutput.kv_connector_block_state, 0.30+);
                           without it a Mamba group is refused
    boundary_state_offloads()  this step's hand-offs, {} where there are none
    KVEventAPI             vLLM's KV cache events (BlockStored/BlockRemoved)
                           with the fields this version has (group_idx and
                           locality from 0.30), and its block-hash helpers
    block_ids_source()     the scheduler's block ids: vLLM's KV cache manager
                           (bound to connectors from 0.30), else tracked from
                           each step's SchedulerOutput (BlockIdTracker)
    lora_identity()        the adapter's name and path: vLLM < 0.32 hashes the
                           name only, and the store outlives an adapter re-pointed
                           under the same name
    hit_sources()          vLLM 0.32+'s per-tier split of a hit
                           (get_external_cache_hit_sources): the NVMe store is
                           DISK, the remote tier EXTERNAL_UNSPECIFIED (vLLM's
                           name for a remote store); {} before 0.32, which
                           never asks
    unsupported()          "" or one line: this vLLM's version and what it lacks
    (stats)                the stats payload is ``data`` on 0.23 and
                           ``to_dict()`` on 0.30+: NPUKVStats has both, the same
                           dict; on 0.23 the scheduler's stats reach the loggers
                           only on steps where a worker sent stats too
                           (docs/metrics.md)
    (sleep mode)           vLLM 0.33+ calls unregister_kv_caches before sleep
                           frees or remaps the KV cache memory, and
                           restore_kv_caches after wake-up: the connector
                           implements both (the worker stops touching the KV
                           pages in between); older vLLM never calls them
    WorkerMetadataBase, create_metric_per_engine: absent before 0.18 / 0.23;
                           stand-ins keep the import working there, and
                           unsupported() turns the connector off

Base-class hooks of later vLLM left at vLLM's default on purpose (each default
is what this connector needs; tests/connector/test_vllm034.py pins them):

    kv_cache_access (0.34)          IN_PROCESS: the workers copy KV pages with
                                    the device's own copies in this process;
                                    only the host ring is registered (device,
                                    Mooncake), never the KV cache
    supports_lookahead_block_hashes False: lookahead keys would make a block's
      (0.34)                        hash depend on tokens after it (the
                                    drafter's KV at a block's end), which the
                                    store's keys do not hold; vLLM then hashes
                                    as before
    may_load_async (0.34)           False (no P/D remote prefill): with
                                    --max-num-inflight-kv-loads a hybrid
                                    model's asynchronous load starts when a
                                    running slot frees, as without the flag
    supports_sleep_mode (0.33+)     True, with the two hooks above
    get_loaded_kv_cache_group_ids   every prefix-cacheable group: the load
      (0.32+)                       writes every non-null block of the hit in
                                    each group, so vLLM may skip zeroing them
    get_mem_pool_context (0.32+)    None: the engine's own memory pool
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

__all__ = [
    "NEWEST",
    "OLDEST",
    "HANDS_OFF_BOUNDARY_STATES",
    "KVEventAPI",
    "REPORTS_FAILED_LOADS",
    "VLLM_VERSION",
    "BlockIdTracker",
    "ManagerBlockIds",
    "TransferResults",
    "WorkerMetadataBase",
    "block_ids_source",
    "boundary_state_offloads",
    "start_loads_before_forward",
    "create_metric_per_engine",
    "hit_sources",
    "kv_cache_layout",
    "kv_events_enabled",
    "lora_identity",
    "unsupported",
]

#: the vLLM minor versions this connector is tested on (README's version table)
OLDEST, NEWEST = (0, 23), (0, 34)
VLLM_VERSION = str(getattr(vllm, "__version__", "unknown"))

_missing: list[str] = []

if hasattr(_base, "KVConnectorTransferResults"):
    TransferResults: Any = _base.KVConnectorTransferResults
    REPORTS_FAILED_LOADS = True
else:

    @dataclass
    class _TransferResults:
        """vLLM < 0.32: what get_finished returns, and the failed loads vLLM
        cannot take back (the connector never makes one there, see
        REPORTS_FAILED_LOADS)."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)

    TransferResults = _TransferResults
    REPORTS_FAILED_LOADS = False

try:
    from vllm.v1.core.sched.output import KVConnectorBlockState as _BlockState

    HANDS_OFF_BOUNDARY_STATES = hasattr(_BlockState, "__dataclass_fields__") and (
        "boundary_state_offloads" in _BlockState.__dataclass_fields__
    )
except ImportError:  # vLLM 0.23
    HANDS_OFF_BOUNDARY_STATES = False


def boundary_state_offloads(scheduler_output: Any) -> dict[str, list[Any]]:
    """``{req_id: [(group_id, block_id, boundary_tokens), ...]}``: the Mamba
    align-mode states vLLM offers this step, by their exact block (vLLM
    0.32's KVCacheManager.take_boundary_state_offloads); {} on older vLLM."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = getattr(block_state, "boundary_state_offloads", None)
    return dict(offloads) if offloads else {}


def start_loads_before_forward(scheduler_output: Any) -> None:
    """Make the worker start this step's loads before its forward.

    vLLM 0.30+ calls start_load_kv after the forward unless the step's
    ``SchedulerOutput.has_sync_kv_loads`` is set (kv_connector_model_runner_mixin).
    vLLM's own scheduler sets it for every synchronous load; vllm-ascend 0.30's
    balance scheduler (patch_balance_schedule.py:798-817) and DyNTRA scheduler
    (core/dyntra_lb_scheduler.py:1174) build their SchedulerOutput without it,
    so their synchronous loads would start after the forward that needs them.
    Set here, as vLLM's HiSparse connector sets it; older vLLM has no field
    and always starts loads first.
    """
    if getattr(scheduler_output, "has_sync_kv_loads", True) is False:
        scheduler_output.has_sync_kv_loads = True


if hasattr(_base, "KVConnectorWorkerMetadata"):
    WorkerMetadataBase: Any = _base.KVConnectorWorkerMetadata
else:  # vLLM < 0.18: out of range; the import must still work to say so
    _missing.append("KVConnectorWorkerMetadata (vLLM 0.18+)")
    WorkerMetadataBase = object

create_metric_per_engine: Any
try:
    from vllm.v1.metrics.utils import create_metric_per_engine
except ImportError:  # vLLM < 0.23 has make_per_engine only
    _missing.append("vllm.v1.metrics.utils.create_metric_per_engine (vLLM 0.23+)")
    create_metric_per_engine = None

if not hasattr(_base, "SupportsHMA"):
    _missing.append("SupportsHMA")

_hit_sources: tuple[Any, Any] | None
try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _HitSource

    _hit_sources = (_HitSource.DISK, _HitSource.EXTERNAL_UNSPECIFIED)
except ImportError:  # vLLM < 0.32: no per-tier hit metrics, nobody asks
    _hit_sources = None


def hit_sources(local_tokens: int, remote_tokens: int) -> dict[Any, int]:
    """A hit's tokens by the tier that supplied them, as vLLM's
    get_external_cache_hit_sources returns them (only non-zero counts): the
    local NVMe store is DISK; the remote tier (a Mooncake Store shared by
    nodes) is EXTERNAL_UNSPECIFIED, vLLM's source for a remote store."""
    if _hit_sources is None:
        return {}
    disk, remote = _hit_sources
    counts = {disk: local_tokens, remote: remote_tokens}
    return {source: n for source, n in counts.items() if n > 0}


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def unsupported(version: str = VLLM_VERSION) -> str:
    """Why the connector cannot run on this vLLM, in one line; "" when it can.

    A version outside 0.23-0.34 is refused even where the features are there:
    its hooks may be called in another order, and a cache that may serve wrong
    KV must not guess. A version string that names no release (a source build)
    is judged by its features alone.
    """
    minor = _minor(version)
    where = f"vLLM {version}"
    if minor is not None and not OLDEST <= minor <= NEWEST:
        span = f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"
        lacks = f"; it lacks {', '.join(_missing)}" if _missing else ""
        return f"{where} is outside the tested range {span}{lacks}"
    if _missing:
        return f"{where} lacks {', '.join(_missing)}"
    return ""


def kv_cache_layout(kv_cache_config: Any) -> str:
    """The engine's KV cache layout name, "" where vLLM has none (< 0.32:
    each backend's own shape, which layout.describe_layer reads from strides)."""
    return str(getattr(kv_cache_config, "kv_cache_layout", None) or "")


def lora_identity(lora_request: Any) -> str:
    """What names an adapter's weights: its name and its path."""
    name = getattr(lora_request, "lora_name", None) or getattr(lora_request, "name", "")
    path = getattr(lora_request, "lora_path", None) or getattr(lora_request, "path", "")
    return f"lora={name!r}@{path!r}"


class BlockIdTracker:
    """vLLM < 0.32: each scheduled request's block ids, rebuilt from the step's
    SchedulerOutput as the model runner rebuilds them (a new request's
    ``block_ids``; a running one's ``new_block_ids`` appended, a resumed one's
    replacing them). Runs in: the scheduler's thread."""

    def __init__(self) -> None:
        self._ids: dict[str, list[list[int]]] = {}

    def update(self, scheduler_output: Any) -> None:
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._ids.pop(req_id, None)
        for req_id in getattr(scheduler_output, "preempted_req_ids", ()) or ():
            self._ids.pop(req_id, None)  # its blocks are freed
        for new in scheduler_output.scheduled_new_reqs:
            self._ids[new.req_id] = [list(group) for group in new.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for req_id, more in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if more is None:
                continue
            have = self._ids.get(req_id)
            if have is None or req_id in resumed:
                self._ids[req_id] = [list(group) for group in more]
            else:
                for group, ids in zip(have, more, strict=True):
                    group += ids

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(self._ids[req_id])

    def forget(self, req_id: str) -> None:
        self._ids.pop(req_id, None)


class ManagerBlockIds:
    """vLLM 0.32+: the block ids from vLLM's own KV cache manager."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def update(self, scheduler_output: Any) -> None:
        """Nothing to track: the manager is the source."""

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(self.manager.get_block_ids(req_id))

    def forget(self, req_id: str) -> None:
        """Nothing to forget: the manager frees its own."""


def block_ids_source(connector: Any) -> ManagerBlockIds | BlockIdTracker:
    """Where the scheduler side reads a request's block ids: vLLM's manager
    where vLLM binds one to the connector (0.32+), else a tracker."""
    manager = getattr(connector, "_kv_cache_manager", None)
    return BlockIdTracker() if manager is None else ManagerBlockIds(manager)


class KVEventAPI:
    """vLLM's KV cache events as the connector builds them: the event
    classes and the hash and extra-key helpers of vLLM's own block pool.
    Fields an event class lacks on this version (``group_idx``,
    ``locality``: 0.32+) are left out."""

    def __init__(self) -> None:
        from vllm.distributed import kv_events
        from vllm.v1.core import kv_cache_utils

        self._stored_cls = kv_events.BlockStored
        self._removed_cls = kv_events.BlockRemoved
        self._utils = kv_cache_utils
        self._stored_fields = set(self._stored_cls.__struct_fields__)
        self._removed_fields = set(self._removed_cls.__struct_fields__)

    def external_hash(self, block_hash: Any) -> Any:
        return self._utils.maybe_convert_block_hash(block_hash)

    def extra_keys(self, request: Any, start: int, end: int) -> Any:
        """The block's extra keys as vLLM's events publish them (untagged on
        0.32+: ``to_event_extra_keys``)."""
        keys, _ = self._utils.generate_block_hash_extra_keys(request, start, end, 0)
        to_event = getattr(self._utils, "to_event_extra_keys", None)
        if to_event is None or keys is None:
            return keys
        converted = to_event([keys])
        return converted[0] if converted else None

    def stored(self, **fields: Any) -> Any:
        if all(keys is None for keys in fields.get("extra_keys") or [None]):
            fields["extra_keys"] = None
        fields.setdefault("locality", "LOCAL")
        return self._stored_cls(
            **{k: v for k, v in fields.items() if k in self._stored_fields}
        )

    def removed(self, block_hashes: list[Any], medium: str, group: int) -> Any:
        fields: dict[str, Any] = {
            "block_hashes": block_hashes,
            "medium": medium,
            "group_idx": group,
            "locality": "LOCAL",
        }
        return self._removed_cls(
            **{k: v for k, v in fields.items() if k in self._removed_fields}
        )


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``--kv-events-config``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(getattr(config, "enable_kv_cache_events", False))
