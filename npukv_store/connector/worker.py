"""The worker half of the connector: device copies between KV pages and the store.

Runs in: every vLLM Worker process (one per TP rank). The hooks run on the
forward thread; layer reads run on one loader thread; chunk writes on the
store's writer thread.

    register()     - describe each layer's byte runs, open the store, register
                     the staging ring with the device
    save_layer()   - layerwise: this layer's blocks -> the ring (async D2H)
    finish_step()  - bulk saves, hand the batch to the writer, collect load errors
    start_load()   - layerwise: start the loader; bulk: load every layer now
    wait_layer()   - the compute stream waits for this layer's H2D copy

Modes (``layerwise``): ``on`` saves and loads in the layer hooks; ``off`` does
everything in start_load_kv / wait_for_save; ``auto`` runs as ``off`` until it
has seen both hooks fire for every layer in one step, then as ``on`` (on an
accelerator; on the CPU it stays ``off``, see ``_learn_hooks``). If a
layer's load hook is ever skipped while a load is pending, the blocks loaded in
that step are reported as load errors (vLLM recomputes them) and the worker
falls back to ``off``: attention may have read them before they arrived.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from npukv_store.config import StoreConfig
from npukv_store.connector.loader import LayerLoader, LoadJob
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.namespace import engine_namespaces
from npukv_store.connector.stats import NPUKVStats
from npukv_store.device.ordering import d2h_after, record_written
from npukv_store.errors import ConfigError
from npukv_store.layout import LayerLayout, LayoutError, build_runs, describe_layer
from npukv_store.store.format import MAX_CHUNK_BLOCKS
from npukv_store.store.store import KVStore, StagedSave

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 30.0


class WorkerSide:
    """Per-worker data path; see the module docstring."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, settings: StoreConfig
    ) -> None:
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        specs = engine_namespaces(vllm_config, kv_cache_config, settings)
        self.rank = 0 if len(specs) == 1 else _tp_rank()
        self.spec = specs[self.rank]
        self.layerwise = settings.layerwise == "on"
        self._observe_hooks = settings.layerwise == "auto"
        self.disabled_reason = ""
        self.store: KVStore | None = None
        self.backend: Any = None
        self.layouts: list[LayerLayout] = []
        self.layer_index: dict[str, int] = {}
        self.stats = NPUKVStats()
        self.totals = NPUKVStats()
        self._last_log = time.monotonic()
        self._meta = NPUKVMetadata()
        self._staged: list[tuple[StagedSave, list[int]]] = []
        self._filled: list[bool] = []
        self._save_planned = False
        self._save_started = 0.0
        self._last_save_event: Any = None
        self._load: LoadJob | None = None
        self.loader: LayerLoader | None = None
        self._load_errors: set[int] = set()
        self._hooks_seen: set[str] = set()
        self._loads_seen: set[str] = set()
        self._warned: set[str] = set()

    # -- registration -------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        try:
            self._register(kv_caches)
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
        for index, layer in enumerate(self.spec.layers):
            if layer.name not in kv_caches:
                raise ConfigError(
                    f"layer {layer.name!r}: in the KV cache config but not among the "
                    f"{len(kv_caches)} registered KV caches"
                )
            layout = describe_layer(
                layer.name, kv_caches[layer.name], num_blocks, npu_format=npu_format
            )
            if layout is None or layout.page_bytes != layer.row_bytes:
                found = "nothing" if layout is None else f"{layout.page_bytes} bytes"
                raise LayoutError(
                    f"layer {layer.name!r}: block page of {found}, expected "
                    f"{layer.row_bytes} bytes (the KV cache spec's page size)"
                )
            self.layouts.append(layout)
            self.layer_index[layer.name] = index
        self.store = KVStore(self.settings, self.spec)
        self.store.prepare_async()
        ring = self.store.ring_buffer()
        self._ring_region = self.backend.register_host(ring.ctypes.data, ring.nbytes)
        self.xfer = self.backend.new_stream()
        self.loader = LayerLoader(
            self.store, self.spec, self.layouts, self.backend, self.xfer,
            self.settings.prefetch_depth,
        )  # fmt: skip
        logger.info(
            "npukv_store: worker rank %d ready: %d layers, %s, %d B per block, "
            "namespace %s, layerwise=%s, ring registered=%s",
            self.rank, len(self.layouts), self.layouts[0].kind,
            self.spec.block_bytes, self.store.namespace[:12],
            self.settings.layerwise, self._ring_region.registered,
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
        self._save_planned = bool(meta.saves) and self.store is not None
        self._staged = []
        self._filled = [False] * len(self.layouts)
        self._hooks_seen.clear()
        self._loads_seen.clear()

    def save_layer(self, layer_name: str) -> None:
        if self._observe_hooks:
            self._hooks_seen.add(layer_name)
        if not (self.layerwise and self._save_planned) or self.disabled_reason:
            return
        index = self.layer_index.get(layer_name)
        if index is None or self._filled[index]:
            return  # another kind of layer (e.g. linear attention's "" hook)
        try:
            self._begin_save()
            self._copy_layer_out(index)
        except Exception:
            self._fail_save("layerwise save")

    def _begin_save(self) -> None:
        """Claim this step's blocks and reserve their ring regions (once)."""
        if self._staged or not self._save_planned:
            return
        assert self.store is not None
        self._save_started = time.perf_counter()
        keys, block_ids = _concat(self._meta.saves, self.rank)
        per_chunk = max(
            1,
            min(
                MAX_CHUNK_BLOCKS,
                self.settings.chunk_target_size // self.spec.block_bytes,
            ),
        )
        for start in range(0, len(keys), per_chunk):
            staged = self.store.begin_save(keys[start : start + per_chunk])
            if staged is not None:
                ids = [block_ids[start + i] for i in staged.indices]
                self._staged.append((staged, ids))
        if not self._staged:
            self._save_planned = False  # all stored, in flight or dropped

    def _copy_layer_out(self, index: int) -> None:
        """D2H of layer ``index``'s blocks into every staged batch, ordered
        after the compute stream's work so far (the layer's KV is written)."""
        layout = self.layouts[index]
        written = record_written(self.backend)
        for staged, block_ids in self._staged:
            src, dst, sizes = build_runs(
                [layout], block_ids, range(len(block_ids)),
                staged.layer_address(index), layout.page_bytes,
            )  # fmt: skip
            with self.backend.stream_ctx(self.xfer):
                d2h_after(self.backend, written, self.xfer, src, dst, sizes)
        self._filled[index] = True

    def _fail_save(self, what: str) -> None:
        self._warn_once(what, f"{what} failed; this step's blocks are not saved")
        assert self.store is not None
        for staged, _ in self._staged:
            self.store.abort_save(staged)
        self._staged = []
        self._save_planned = False

    def finish_step(self) -> None:
        """wait_for_save: copy what the hooks did not, queue the saves, and
        settle this step's loads. Never waits for the disk."""
        if self._observe_hooks:
            self._learn_hooks()
        if self._save_planned and not self.disabled_reason:
            try:
                self._begin_save()
                for index, filled in enumerate(self._filled):
                    if not filled and self._staged:
                        self._copy_layer_out(index)
                self._commit_saves()
            except Exception:
                self._fail_save("save")
        self._save_planned = False
        if self._load is not None:
            self._settle_load(self._load)
            self._load = None
        self._maybe_log()

    def _commit_saves(self) -> None:
        if not self._staged:
            return
        assert self.store is not None
        done = self.backend.new_event()
        done.record(self.xfer)
        blocks = 0
        for staged, _ in self._staged:
            self.store.commit_save(staged, done)
            blocks += len(staged.keys)
        self._staged = []
        self._last_save_event = done
        self.stats.add(
            saved_blocks=blocks,
            saved_bytes=blocks * self.spec.block_bytes,
            save_seconds=time.perf_counter() - self._save_started,
        )

    def _learn_hooks(self) -> None:
        """auto: switch to layerwise once both hooks fired for every layer, on
        a device whose copies run beside compute. On the CPU they would share
        the same cores: layerwise only adds a thread hand-off per layer there
        (measured TTFT of a warm 2,000-token hit: about 90 ms layerwise against
        70 ms bulk), so auto stays bulk."""
        names = self.layer_index.keys()
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
        if self._last_save_event is not None:
            self._last_save_event.synchronize()
            self._last_save_event = None

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
        loads = self._meta.loads
        if not loads:
            return
        keys, block_ids = _concat(loads, self.rank)
        if self.disabled_reason or self.loader is None:
            self._load_errors.update(block_ids)
            return
        try:
            job = self.loader.new_job(keys, block_ids)
            if self.layerwise:
                self.loader.submit(job)
                self._load = job
                return
            self.loader.run(job)
            for index in range(len(self.layouts)):
                self.loader.wait_layer(job, index)
            self._settle_load(job)
        except Exception:
            self._warn_once("load", "load failed; its blocks are recomputed")
            self._load_errors.update(block_ids)

    def wait_layer(self, layer_name: str) -> None:
        if self._observe_hooks:
            self._loads_seen.add(layer_name)
        job = self._load
        if job is None or self.loader is None:
            return
        index = self.layer_index.get(layer_name)
        if index is not None:
            self.loader.wait_layer(job, index)

    def _settle_load(self, job: LoadJob) -> None:
        assert self.loader is not None
        self.loader.settle(job)
        if not all(job.waited):
            # attention ran on some layer before its blocks arrived
            job.errors.update(job.block_ids)
            self.layerwise = False
            logger.warning(
                "npukv_store: a layer's load hook was skipped; falling back to "
                "layerwise=off (this step's loaded blocks are recomputed)"
            )
        good = len(job.block_ids) - len(set(job.block_ids) & job.errors)
        if job.errors:
            logger.warning(
                "npukv_store: %d of %d blocks failed to load (missing, evicted or "
                "corrupt); vLLM recomputes them",
                len(job.errors), len(job.block_ids),
            )  # fmt: skip
        self._load_errors.update(job.errors)
        self.stats.add(
            loaded_blocks=good,
            loaded_bytes=good * self.spec.block_bytes,
            load_seconds=time.perf_counter() - job.started,
            load_errors=len(job.errors),
        )

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- stats and shutdown ---------------------------------------------------------

    def take_stats(self) -> NPUKVStats | None:
        stats = self.stats
        if self.store is not None:
            counters = self.store.counters.snapshot()
            dropped = counters.get("dropped_blocks", 0)
            stats.add(dropped_blocks=dropped - self.totals.data["dropped_blocks"])
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
        if self.store is not None:
            self.fence()  # no device copy uses the ring or the slots any more
        region = getattr(self, "_ring_region", None)
        if region is not None:
            region.close()
        if self.store is not None:
            self.store.close()  # drains the writer, then unlinks the ring
            self.store = None

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("npukv_store: %s", message, exc_info=True)


def _concat(transfers: list[BlockTransfer], rank: int) -> tuple[list[bytes], list[int]]:
    keys: list[bytes] = []
    block_ids: list[int] = []
    for transfer in transfers:
        keys += transfer.keys(rank)
        block_ids += transfer.block_ids
    return keys, block_ids


def _first_tensor(kv_caches: dict[str, Any]) -> Any:
    for value in kv_caches.values():
        if isinstance(value, list | tuple):
            if value:
                return value[0]
        else:
            return value
    raise ConfigError("register_kv_caches: found no tensors, expected KV caches")


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
