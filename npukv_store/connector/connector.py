"""NPUKVStoreConnector: vLLM's KVConnectorBase_V1 over the npukv_store.

Runs in: EngineCore (role SCHEDULER) and every Worker (role WORKER); vLLM makes
one object per role and process. Loaded with
``kv_connector_module_path="npukv_store.connector"``, no change to vLLM.

This class only adapts vLLM's calls to :class:`SchedulerSide` and
:class:`WorkerSide` and keeps every fault inside: a failing hook logs and
degrades to "miss" / "not saved", it never raises into the serving process.
Start-up too: an unsupported vLLM (connector/vllm_api.py), a bad configuration
or any fault while a side starts turns the connector off with one error line,
and vLLM serves without it (docs/decisions/0056-vllm-versions.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from npukv_store.config import StoreConfig
from npukv_store.connector import vllm_api
from npukv_store.connector.metadata import NPUKVMetadata, NPUKVWorkerMetadata
from npukv_store.connector.prometheus import NPUKVPromMetrics
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.stats import NPUKVStats
from npukv_store.connector.vllm_api import TransferResults
from npukv_store.connector.worker.side import WorkerSide
from npukv_store.errors import NpuKVError

logger = logging.getLogger(__name__)


def _log_where_vllm_logs() -> None:
    """Our loggers ("npukv_store.*") use vLLM's handlers and level, so the
    operator finds our lines in the server's log, in its format."""
    ours = logging.getLogger("npukv_store")
    vllm_logger = logging.getLogger("vllm")
    if ours.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.level or logging.INFO)
    ours.propagate = False


class NPUKVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """A crash-safe local NVMe KV tier shared by every process of a node.

    SupportsHMA: vLLM keeps its hybrid KV cache manager on with this connector
    (sliding-window layers keep only their window; hybrid models start). Each
    KV cache group is a namespace of its own (see :mod:`.groups`); groups of a
    kind the store cannot serve turn the connector off at start-up.
    """

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_where_vllm_logs()
        self.settings: StoreConfig | None = None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        #: sleep mode (vLLM 0.33+): between unregister_kv_caches and
        #: restore_kv_caches the KV cache memory may be freed or remapped
        self._asleep = False
        #: asynchronous loads stopped at unregister_kv_caches, reported failed
        self._stopped_loads: set[str] = set()
        try:
            reason = vllm_api.unsupported()
            if reason:
                _turn_off(role, reason)
                return
            transfer = vllm_config.kv_transfer_config
            self.settings = StoreConfig.from_extra_config(
                dict(transfer.kv_connector_extra_config or {})
            )
            if role == KVConnectorRole.SCHEDULER:
                _recompute_failed_loads(transfer)
                self._scheduler = SchedulerSide(
                    vllm_config, kv_cache_config, self.settings
                )
            else:
                self._worker = WorkerSide(vllm_config, kv_cache_config, self.settings)
        except Exception as exc:  # never into vLLM: it serves without us
            self._scheduler = self._worker = None
            _turn_off(role, _startup_failure(exc))

    # -- properties vLLM asks ---------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a preempted request just recomputes

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layerwise hooks run in Python, so full graphs would skip them."""
        return str(extra_config.get("layerwise", "auto")).lower() in ("on", "auto")

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> NPUKVStats | None:
        return NPUKVStats.from_dict(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> NPUKVPromMetrics:
        """The ``vllm:npukv_*`` metrics on vLLM's /metrics (connector/prometheus.py)."""
        return NPUKVPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker is not None:
            self._worker.register(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+, before sleep mode frees or remaps the KV cache memory
        (and before a weight update borrows it): from here until
        restore_kv_caches nothing of ours may touch the KV pages. vLLM has
        drained transfers; the saves' device copies out of the pages are
        fenced, and an asynchronous load still running is stopped and
        reported failed (vLLM recomputes it). Idempotent."""
        self._asleep = True
        if self._worker is None:
            return
        try:
            self._worker.fence()
            self._stopped_loads |= self._worker.abandon_loads()
        except Exception:
            logger.exception("npukv_store: unregister_kv_caches failed")

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+, after wake-up: the KV cache is back at the same
        addresses (vLLM keeps the views), so the registration still holds.
        Idempotent."""
        self._asleep = False

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, NPUKVMetadata):
            self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            _guard(self._worker.fence, "handle_preemptions")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return
        if self._asleep:  # no step runs asleep; if one does, it loads nothing
            _guard(self._refuse_loads, "start_load_kv")
            return
        _guard(self._worker.start_load, "start_load_kv")

    def _refuse_loads(self) -> None:
        """The bound step's loads, reported failed without a copy."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, NPUKVMetadata):
            self._worker.loads.start(meta, layerwise=False, disabled=True)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            _guard(self._worker.wait_layer, "wait_for_layer_load", layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._worker is not None and not self._asleep:
            _guard(self._worker.save_layer, "save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None and not self._asleep:  # asleep: not saved
            _guard(self._worker.finish_step, "wait_for_save")

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32+ calls this; older ones call get_finished, which cannot
        report failed loads (the scheduler makes none there: vllm_api)."""
        if self._worker is None:
            return TransferResults()
        try:
            sending, recving, failed = self._worker.transfer_results()
        except Exception:
            logger.exception("npukv_store: get_transfer_results failed")
            sending = self._worker.held_requests()
            failed = self._worker.abandon_loads()  # vLLM must not wait for ever
            recving = set(failed)
        if self._stopped_loads:
            failed |= self._stopped_loads
            recving |= self._stopped_loads
            self._stopped_loads = set()
        return TransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> NPUKVStats | None:
        side = self._worker or self._scheduler
        return side.take_stats() if side is not None else None

    def build_connector_worker_meta(self) -> NPUKVWorkerMetadata | None:
        worker = self._worker
        if worker is None:
            return None
        if worker.disabled_reason:
            return NPUKVWorkerMetadata(worker.disabled_reason)
        try:
            loads, steps = worker.take_costs()
        except Exception:
            logger.exception("npukv_store: measuring costs failed")
            return None
        if not (loads or steps):
            return None
        return NPUKVWorkerMetadata(load_samples=loads, step_samples=steps)

    def shutdown(self) -> None:
        side = self._worker or self._scheduler
        if side is not None:
            _guard(side.close, "shutdown")

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        tokens = self._scheduler.match(request, num_computed_tokens)
        if tokens is None:  # vLLM asks again in the next step
            return None, False
        return tokens, tokens > 0 and self._scheduler.load_async

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """vLLM 0.32+'s hit metrics by tier, asked after
        update_state_after_alloc: the NVMe store's tokens and the remote
        tier's (vllm_api.hit_sources). The counts sum to
        ``num_external_tokens``."""
        if num_external_tokens <= 0:
            return {}
        try:
            remote = _remote_tokens(self._scheduler, request, num_external_tokens)
        except Exception:
            logger.exception("npukv_store: get_external_cache_hit_sources failed")
            remote = 0
        return vllm_api.hit_sources(num_external_tokens - remote, remote)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        if self._scheduler is None:
            return
        try:
            block_ids = blocks.get_block_ids()
            self._scheduler.allocated(request, block_ids, num_external_tokens)
        except Exception:
            logger.exception("npukv_store: update_state_after_alloc failed")
            if num_external_tokens > 0 and self._scheduler.load_async:
                self._scheduler.fail_load(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._scheduler is None:
            return NPUKVMetadata()
        try:
            if self._scheduler.block_ids is None:  # vLLM binds its manager late
                self._scheduler.block_ids = vllm_api.block_ids_source(self)
            return self._scheduler.build_meta(scheduler_output)
        except Exception:
            logger.exception("npukv_store: build_connector_meta failed")
            return NPUKVMetadata()

    def take_events(self) -> Iterable[Any]:
        """KV cache events of the NVMe tier (docs/metrics.md, "KV events"):
        vLLM publishes them with its own where --kv-events-config is set."""
        if self._scheduler is None:
            return ()
        return self._scheduler.take_events()

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if meta is None or self._scheduler is None:
            return
        reason = getattr(meta, "disabled_reason", "")
        if reason:
            self._scheduler.disable(f"a worker is off: {reason}")
        try:
            self._scheduler.measured(
                getattr(meta, "load_samples", ()), getattr(meta, "step_samples", ())
            )
        except Exception:
            logger.exception("npukv_store: update_connector_output failed")

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        try:
            return self._scheduler.finished(request), None
        except Exception:
            logger.exception("npukv_store: request_finished failed")
            return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA's request_finished: the same, whatever the groups' blocks."""
        return self.request_finished(request, block_ids[0] if block_ids else [])


_reported_off: set[str] = set()


def _turn_off(role: Any, reason: str) -> None:
    """The one error line of a connector that will not run in this process
    (both roles share a process where vLLM runs the engine in-process)."""
    if reason in _reported_off:
        return
    _reported_off.add(reason)
    side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
    logger.error(
        "npukv_store: the connector is off (%s), vLLM serves without it: %s",
        side, reason,
    )  # fmt: skip


def _startup_failure(exc: BaseException) -> str:
    """A configuration error says what was found and expected itself; any
    other fault is named with its type, and its traceback goes to DEBUG."""
    if isinstance(exc, NpuKVError):
        return str(exc)
    logger.debug("npukv_store: start-up failed", exc_info=exc)
    return f"start-up failed: {exc!r} (vLLM {vllm_api.VLLM_VERSION})"


def _recompute_failed_loads(transfer: Any) -> None:
    """A cache must never fail a request: a block that cannot be loaded is
    recomputed. The scheduler reads this after the connector is built."""
    if transfer.kv_load_failure_policy != "recompute":
        logger.info(
            "npukv_store: kv_load_failure_policy %r -> 'recompute'",
            transfer.kv_load_failure_policy,
        )
        transfer.kv_load_failure_policy = "recompute"


def _remote_tokens(scheduler: SchedulerSide | None, request: Any, tokens: int) -> int:
    """How many of a hit's ``tokens`` the remote tier supplies: the blocks
    from the request's ``remote_from`` on, as SchedulerSide.allocated split
    its load (0 without a remote tier: its hits end where the local ones do)."""
    state = None if scheduler is None else scheduler._requests.get(request.request_id)
    if state is None:
        return 0
    bs = scheduler.block_size  # type: ignore[union-attr]
    start = state.local_tokens // bs
    stop = start + tokens // bs
    split = max(start, min(stop, state.remote_from))
    return (stop - split) * bs


def _guard(fn: Any, hook: str, *args: Any) -> None:
    """Run a worker hook; a fault is logged, never raised into vLLM."""
    try:
        fn(*args)
    except Exception:
        logger.exception("npukv_store: %s failed", hook)
