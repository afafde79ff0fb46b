"""One worker's loads of a step: stored blocks -> KV pages, and their results.

Runs in: every vLLM Worker process (one per TP rank), on the forward thread
(start_load_kv, wait_for_layer_load, wait_for_save, get_finished); the reads
and their H2D copies run on the loader's threads (connector/worker/loader.py).

    attach()       - the loader and what a load is counted against, once the
                     worker registered its KV caches
    start()        - layerwise: submit the step's job, read as the forward
                     reaches its layers; bulk, or a step predicted to skip its
                     wait hooks: load every layer now; asynchronous loads
                     (hybrid models): start them off the step
    wait_layer()   - the compute stream waits for one layer's H2D copy
    finish_step()  - settle the step's layerwise job (wait_for_save)
    take_errors()  - block ids that failed to load since the last call
    results()      - asynchronous loads done, and those failed
    abandon()      - every asynchronous load still pending, as failed

A layerwise job whose layer was never waited on (its load hook skipped) may
have been read by attention before its blocks arrived: the step's blocks are
load errors (vLLM recomputes them) and the worker is told to fall back to
``layerwise: off`` for good (decision 0034). Steps whose attention is known to
skip the wait hooks (vllm-ascend's MLA on decode-sized steps, decode graphs:
:mod:`.ascend_rules`) load in bulk instead, fenced before any attention, and
the worker stays layerwise (docs/device.md §6.2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from npukv_store.connector.metadata import (
    BlockTransfer,
    NPUKVMetadata,
    concat_transfers,
)
from npukv_store.connector.stats import NPUKVStats
from npukv_store.connector.worker.ascend_rules import SkippedWaits
from npukv_store.connector.worker.costs import CostMeter
from npukv_store.connector.worker.loader import LayerLoader, LoadJob
from npukv_store.spec import NamespaceSpec

logger = logging.getLogger(__name__)


class StepLoads:
    """The load half of a WorkerSide; see the module docstring."""

    def __init__(
        self,
        skipped_waits: SkippedWaits,
        stats: Callable[[], NPUKVStats],
        warn_once: Callable[[str, str], None],
        fall_back: Callable[[], None],
    ) -> None:
        self.skipped_waits = skipped_waits
        # a getter, not the object: the worker hands its stats over and
        # starts new ones at every take_stats
        self._stats = stats
        self._warn_once = warn_once
        self._fall_back = fall_back  # a load hook was skipped: layerwise off
        # set by attach(); until then (or when registration failed) every
        # load is an error
        self.loader: LayerLoader | None = None
        self._costs: CostMeter | None = None
        self._specs: Sequence[NamespaceSpec] = ()
        self._rank = 0
        self._kind = ""  # the backend's kind
        #: this step's layerwise job, waited for layer by layer; None once
        #: settled (finish_step) or when the step loads in bulk
        self.job: LoadJob | None = None
        self._async_jobs: list[LoadJob] = []
        self._failed_recving: set[str] = set()
        self._errors: set[int] = set()
        self.wait_s = 0.0  # this step's forward thread waiting for loads

    def attach(
        self,
        loader: LayerLoader,
        costs: CostMeter,
        specs: Sequence[NamespaceSpec],
        rank: int,
        kind: str,
    ) -> None:
        self.loader, self._costs = loader, costs
        self._specs, self._rank, self._kind = specs, rank, kind

    def begin_step(self) -> None:
        self.wait_s = 0.0

    def start(
        self,
        meta: NPUKVMetadata,
        *,
        layerwise: bool,
        disabled: bool,
        after_forward: bool = False,
    ) -> None:
        """start_load_kv: the step's loads (``layerwise``: the worker's mode;
        ``disabled``: the connector is off on this worker; ``after_forward``:
        a layer hook of this step already ran).

        vLLM 0.30+ calls start_load_kv after the forward unless the step's
        SchedulerOutput.has_sync_kv_loads is set. Asynchronous loads are
        right either way: their requests are not in this forward. A
        synchronous load that starts after the forward fed nothing: the
        forward read its blocks unloaded. Its blocks are load errors, so
        vLLM drops the step's tokens of those requests and recomputes (the
        scheduler side sets the flag for its synchronous loads; this is for
        a scheduler that rebuilds SchedulerOutput without it).
        """
        self._failed_recving.update(meta.failed_loads)
        loads = [t for t in meta.loads if not t.asynchronous]
        later = [t for t in meta.loads if t.asynchronous]
        if later:
            self._start_async(later, disabled)
        if not loads:
            return
        if after_forward and not disabled:
            self._warn_once(
                "late-load",
                "vLLM started this step's synchronous loads after its forward "
                "(SchedulerOutput.has_sync_kv_loads was not set); their blocks "
                "are recomputed",
            )
        if disabled or after_forward or self.loader is None:
            self._errors.update(b for t in loads for b in t.block_ids)
            return
        try:
            layerwise = layerwise and not self._waits_may_be_skipped(meta)
            job = self._new_job(loads, gated=layerwise)
            if layerwise:
                self.loader.submit(job)
                self.job = job
                return
            waited = time.perf_counter()
            self.loader.run(job)
            for index in range(len(job.done)):  # one entry per layer
                self.loader.wait_layer(job, index)
            self._settle(job)
            self.wait_s += time.perf_counter() - waited
        except Exception:
            self._warn_once("load", "load failed; its blocks are recomputed")
            self._errors.update(b for t in loads for b in t.block_ids)

    def _waits_may_be_skipped(self, meta: NPUKVMetadata) -> bool:
        """This step's attention may call no wait hook (vllm-ascend's MLA on
        a step of decode-sized requests): its loads are then fenced here, in
        bulk, before any attention reads the pages; the next steps stay
        layerwise."""
        return self.skipped_waits.may_skip(self._kind, meta.max_request_tokens)

    def _start_async(self, loads: list[BlockTransfer], disabled: bool) -> None:
        """Loads vLLM waits for off the forward (WAITING_FOR_REMOTE_KVS): read
        on the loader thread, reported per request by results()."""
        requests = {t.req_id for t in loads}
        if disabled or self.loader is None:
            self._failed_recving.update(requests)
            return
        try:
            job = self._new_job(loads, gated=False)
            for t in loads:
                job.requests.setdefault(t.req_id, set()).update(t.block_ids)
            self.loader.submit(job, layer_by_layer=False)
            self._async_jobs.append(job)
        except Exception:
            self._warn_once("load", "load failed; its blocks are recomputed")
            self._failed_recving.update(requests)

    def _new_job(self, loads: list[BlockTransfer], *, gated: bool) -> LoadJob:
        assert self.loader is not None
        keys, block_ids = self._per_group([t for t in loads if not t.remote])
        job = self.loader.new_job(keys, block_ids, gated=gated)
        remote = [t for t in loads if t.remote]
        if remote:
            job.remote_keys, job.remote_block_ids = self._per_group(remote)
        if self._costs is not None:
            job.read_before = self._costs.load_started()
        return job

    def _per_group(
        self, loads: list[BlockTransfer]
    ) -> tuple[list[list[bytes]], list[list[int]]]:
        pairs = [
            concat_transfers([t for t in loads if t.group == g], self._rank)
            for g in range(len(self._specs))
        ]
        return [k for k, _ in pairs], [b for _, b in pairs]

    def wait_layer(self, index: int) -> None:
        """wait_for_layer_load of the worker's layer ``index``."""
        job = self.job
        if job is None or self.loader is None:
            return
        waited = time.perf_counter()
        self.loader.wait_layer(job, index)
        self.wait_s += time.perf_counter() - waited

    def finish_step(self) -> None:
        """wait_for_save: settle the step's layerwise job, and report the
        step's wait (the slowest worker's is what the forward lost)."""
        if self.job is not None:
            waited = time.perf_counter()
            self._settle(self.job)
            self.wait_s += time.perf_counter() - waited
            self.job = None
        if self.wait_s > 0:
            self._stats().peak("load_wait_seconds", self.wait_s)

    def _settle(self, job: LoadJob) -> None:
        assert self.loader is not None
        self.loader.settle(job)
        if not all(job.waited):
            # attention ran on some layer before its blocks arrived
            job.errors.update(job.all_block_ids())
            self._fall_back()
            logger.warning(
                "npukv_store: a layer's load hook was skipped; falling back to "
                "layerwise=off (this step's loaded blocks are recomputed)"
            )
        self._errors.update(job.errors - job.reported)
        self._count(job)

    def _count(self, job: LoadJob) -> None:
        total = good = nbytes = 0
        for group, ids in [*enumerate(job.block_ids), *enumerate(job.remote_block_ids)]:
            ok = len(ids) - len(set(ids) & job.errors)
            total += len(ids)
            good += ok
            nbytes += ok * self._specs[group].block_bytes
        if job.errors:
            logger.warning(
                "npukv_store: %d of %d blocks failed to load (missing, evicted or "
                "corrupt); vLLM recomputes them",
                total - good, total,
            )  # fmt: skip
        seconds = (job.ended or time.perf_counter()) - job.started
        self._stats().add(
            loaded_blocks=good,
            loaded_bytes=nbytes,
            load_seconds=seconds,
            load_errors=total - good,
        )
        if self._costs is not None and job.read_before is not None:
            self._costs.load_done(job.read_before, seconds)

    def take_errors(self) -> set[int]:
        """Block ids that failed to load since the last call.

        With a speculator vLLM asks before wait_for_save (``defer_finalize``:
        the draft model runs in between), while this step's layerwise job is
        still unsettled. The errors of the layers the forward waited on are
        known by then (a layer's failure is published with its copy), and
        they must reach vLLM with this step's output, before its tokens are
        sampled: they are handed over now, and settling adds only the rest
        (a draft layer's read, or a skipped hook).
        """
        job = self.job
        if job is not None:
            with job.cond:
                early = job.errors - job.reported
                job.reported |= early
            self._errors |= early
        errors, self._errors = self._errors, set()
        return errors

    def results(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving): asynchronous loads that
        are done (a failed one is in both; vLLM recomputes it)."""
        failed, self._failed_recving = self._failed_recving, set()
        recving = set(failed)
        pending = []
        for job in self._async_jobs:
            if self.loader is None or not self.loader.complete(job):
                pending.append(job)
                continue
            self._count(job)
            for req_id, ids in job.requests.items():
                recving.add(req_id)
                if ids & job.errors:
                    failed.add(req_id)
        self._async_jobs = pending
        return recving, failed

    def abandon(self) -> set[str]:
        """Every asynchronous load still pending, once its reads and copies
        have stopped (its blocks may be reused after): all to be reported
        failed when results cannot be collected."""
        requests = set(self._failed_recving)
        self._failed_recving = set()
        for job in self._async_jobs:
            if self.loader is not None:
                self.loader.settle(job)
            requests.update(job.requests)
        self._async_jobs = []
        return requests
