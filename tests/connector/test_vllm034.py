"""What vLLM 0.30 to 0.34's connector hooks mean for the connector
(connector/vllm_api.py's table, docs/vllm.md §3):

- a failed load of a model of several KV cache groups reaches vLLM through
  ``failed_recving`` only, never as block ids: vLLM 0.32+ raises RuntimeError
  on a block error of several groups (``Scheduler._handle_invalid_blocks``),
  and its ``_handle_failed_recving`` is what takes the request back here;
- sleep mode (0.33+): between unregister_kv_caches and restore_kv_caches
  nothing of the connector touches the KV pages;
- the per-tier hit split of 0.32+ (get_external_cache_hit_sources);
- the base-class hooks left at vLLM's default on purpose keep the values
  the connector relies on.

vLLM's own scheduler methods run here on a stand-in of the scheduler with
the attributes they read; each test skips, saying why, where this lane's
vLLM lacks what it checks (0.23 has no failed_recving: hybrid models only
save there, test_vllm_api.py).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import base as vllm_base
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from npukv_store.connector import vllm_api
from npukv_store.connector.connector import NPUKVStoreConnector
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from tests.support.connector import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    LAYERS4,
    NUM_BLOCKS,
    cpu_caches,
    engine_config,
    hybrid_config,
    make_request,
    put_blocks,
)

needs_failed_recving = pytest.mark.skipif(
    not vllm_api.REPORTS_FAILED_LOADS,
    reason=f"vLLM {vllm_api.VLLM_VERSION} has no failed_recving: hybrid models "
    "only save there",
)
MINOR = vllm_api._minor(vllm_api.VLLM_VERSION) or (0, 0)


def _extra(tmp_path) -> dict:
    return {"cache_dir": str(tmp_path / "cache"), "ring_size": "8MiB"}


def _hybrid_caches(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen)
        for name in LAYERS4
    }


def _async_loads(req: str) -> NPUKVMetadata:
    """An asynchronous load of both groups of the hybrid model, of blocks
    the store does not hold (as the scheduler side plans one, decision 0041)."""
    missing = [bytes([9, i]) * 8 for i in range(3)]
    return NPUKVMetadata(
        loads=[
            BlockTransfer(req, [20, 21], [b"".join(missing[:2])], group=0,
                          asynchronous=True),
            BlockTransfer(req, [22, 23, 24], [b"".join(missing)], group=1,
                          asynchronous=True),
        ]
    )  # fmt: skip


def _worker(tmp_path, caches) -> NPUKVStoreConnector:
    vllm_config, kv_cache_config = hybrid_config(extra=_extra(tmp_path))
    connector = NPUKVStoreConnector(
        vllm_config, KVConnectorRole.WORKER, kv_cache_config
    )
    connector.register_kv_caches(caches)
    return connector


def _step(connector: NPUKVStoreConnector, meta: NPUKVMetadata) -> None:
    """One worker step as vLLM's model runner drives the hooks."""
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.clear_connector_metadata()


def _output_when_received(connector: NPUKVStoreConnector, req: str):
    """vLLM's KVConnectorOutput of the step that reports ``req`` received,
    filled as the model runner fills it (gpu/kv_connector.py post_forward)."""
    from vllm.v1.outputs import KVConnectorOutput

    recving: set[str] = set()
    failed: set[str] = set()
    invalid: set[int] = set()
    for _ in range(3000):
        results = connector.get_transfer_results(set())
        recving |= results.finished_recving
        failed |= results.failed_recving
        invalid |= connector.get_block_ids_with_load_errors()
        if req in recving:
            break
        time.sleep(0.01)
    return KVConnectorOutput(
        finished_recving=recving or None,
        failed_recving=failed,
        invalid_block_ids=invalid,
    )


def _vllm_scheduler(req: str, groups: int) -> SimpleNamespace:
    """The scheduler's state that vLLM's failed-load handlers read: one
    request waiting for its asynchronous load."""
    from vllm.v1.request import RequestStatus

    request = SimpleNamespace(
        request_id=req,
        status=RequestStatus.WAITING_FOR_REMOTE_KVS,
        num_computed_tokens=3 * BLOCK,
    )
    return SimpleNamespace(
        requests={req: request},
        recompute_kv_load_failures=True,
        failed_recving_kv_req_ids=set(),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[object()] * groups),
    )


# -- failed loads of several KV cache groups -----------------------------------------


def _stop_in_results(connector: NPUKVStoreConnector) -> None:
    def broken():
        raise RuntimeError("injected: collecting results failed")

    connector._worker.transfer_results = broken  # type: ignore[union-attr]


def _off_worker(connector: NPUKVStoreConnector) -> None:
    connector._worker.disable("injected: this worker is off")  # type: ignore[union-attr]


@needs_failed_recving
@pytest.mark.parametrize(
    "failure", ["missing blocks", "worker off", "results fault", "asleep"]
)
def test_a_failed_load_of_several_groups_reaches_vllm_as_failed_recving(
    tmp_path, failure, caplog
):
    """Whatever fails (the store lacks the blocks, the worker is off, its
    results cannot be collected, vLLM put the KV cache to sleep), the request
    comes back through failed_recving and vLLM's own handler takes it back
    for a recompute; no block id reaches get_block_ids_with_load_errors,
    which vLLM 0.32+ refuses with RuntimeError for several groups."""
    from vllm.v1.core.sched.scheduler import Scheduler

    connector = _worker(tmp_path, _hybrid_caches(1))
    if failure == "worker off":
        _off_worker(connector)
    with caplog.at_level(logging.CRITICAL, logger="npukv_store"):
        if failure == "asleep":
            connector.unregister_kv_caches()
        _step(connector, _async_loads("r"))
        if failure == "results fault":
            _stop_in_results(connector)
        output = _output_when_received(connector, "r")
    assert output.finished_recving == {"r"}
    assert output.failed_recving == {"r"}
    assert output.invalid_block_ids == set()
    vllm_scheduler = _vllm_scheduler("r", groups=2)
    Scheduler._handle_failed_recving(vllm_scheduler, output.failed_recving)
    assert vllm_scheduler.failed_recving_kv_req_ids == {"r"}
    assert vllm_scheduler.requests["r"].num_computed_tokens == 0  # recomputed
    connector.shutdown()


@needs_failed_recving
@pytest.mark.skipif(MINOR < (0, 32), reason="vLLM < 0.32 maps them per request")
def test_vllm_refuses_block_errors_of_several_groups():
    """Why the routing above matters: the EngineCore raises on any block id
    reported for a model of several groups (0.32+, 0.34 included)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    with pytest.raises(RuntimeError, match="failed_recving"):
        Scheduler._handle_invalid_blocks(_vllm_scheduler("r", groups=2), {21}, {})


# -- sleep mode (vLLM 0.33+) ---------------------------------------------------------


def _saved_blocks(connector: NPUKVStoreConnector) -> int:
    store = connector._worker.store  # type: ignore[union-attr]
    assert store is not None
    assert store.flush(timeout_s=30)
    return store.stats().num_blocks


def test_asleep_the_worker_neither_copies_nor_loads_and_wakes_as_before(tmp_path):
    """unregister_kv_caches: a step vLLM runs anyway copies nothing out of or
    into the KV pages (a load of stored blocks fails, a save is dropped);
    after restore_kv_caches the same registration saves and loads again."""
    caches = cpu_caches(1)
    vllm_config, kv_cache_config = engine_config(extra=_extra(tmp_path))
    connector = NPUKVStoreConnector(
        vllm_config, KVConnectorRole.WORKER, kv_cache_config
    )
    connector.register_kv_caches(caches)
    stored = [bytes([3, i]) * 8 for i in range(2)]
    other = [bytes([4, i]) * 8 for i in range(2)]
    _step(
        connector, NPUKVMetadata(saves=[BlockTransfer("a", [1, 2], [b"".join(stored)])])
    )
    assert _saved_blocks(connector) == 2
    load = BlockTransfer("l", [5, 6], [b"".join(stored)])
    save = BlockTransfer("s", [3, 4], [b"".join(other)])
    before = {name: t.clone() for name, t in caches.items()}
    connector.unregister_kv_caches()
    connector.unregister_kv_caches()  # idempotent
    _step(connector, NPUKVMetadata(saves=[save], loads=[load]))
    assert connector.get_block_ids_with_load_errors() == {5, 6}
    assert _saved_blocks(connector) == 2
    for name, tensor in caches.items():
        assert torch.equal(tensor, before[name]), f"{name} touched asleep"
    connector.restore_kv_caches()
    _step(connector, NPUKVMetadata(saves=[save], loads=[load]))
    assert connector.get_block_ids_with_load_errors() == set()
    assert _saved_blocks(connector) == 4
    for name, tensor in caches.items():
        assert torch.equal(tensor[[5, 6]], before[name][[1, 2]]), name
    connector.shutdown()


@needs_failed_recving
def test_unregister_stops_a_running_async_load_before_returning(tmp_path):
    """An asynchronous load still reading when vLLM unregisters has stopped
    writing into the pages when unregister_kv_caches returns, and is
    reported failed afterwards (once)."""
    connector = _worker(tmp_path, _hybrid_caches(2))
    _step(connector, _async_loads("r"))
    connector.unregister_kv_caches()
    assert connector._worker.loads._async_jobs == []  # type: ignore[union-attr]
    results = connector.get_transfer_results(set())
    assert "r" in results.failed_recving
    assert "r" in results.finished_recving
    again = connector.get_transfer_results(set())
    assert "r" not in again.failed_recving | again.finished_recving
    connector.shutdown()


# -- hit sources (vLLM 0.32+) --------------------------------------------------------


def test_hit_sources_split_the_store_and_the_remote_tier():
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        assert vllm_api.hit_sources(48, 16) == {}  # nobody asks before 0.32
        return
    disk, remote = CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED
    assert vllm_api.hit_sources(48, 16) == {disk: 48, remote: 16}
    assert vllm_api.hit_sources(64, 0) == {disk: 64}
    assert vllm_api.hit_sources(0, 32) == {remote: 32}


def test_a_local_hit_is_counted_as_disk_and_sums_to_the_hit(tmp_path):
    vllm_config, kv_cache_config = engine_config(extra=_extra(tmp_path))
    connector = NPUKVStoreConnector(
        vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    side = connector._scheduler
    assert side is not None
    request = make_request("r", list(range(4 * BLOCK + 1)))
    ((keys,),) = side._keys(side._state(request), 4)
    put_blocks(side.settings, side.engine.specs[0][0], keys)
    assert connector.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(1, 6)),))
    connector.update_state_after_alloc(request, blocks, 4 * BLOCK)
    sources = connector.get_external_cache_hit_sources(request, 4 * BLOCK)
    assert sum(sources.values()) == (4 * BLOCK if sources else 0)
    if vllm_api.hit_sources(1, 0):  # vLLM 0.32+
        assert sources == vllm_api.hit_sources(4 * BLOCK, 0)
    # the blocks from remote_from on came from the remote tier
    side._requests["r"].remote_from = 3
    split = connector.get_external_cache_hit_sources(request, 4 * BLOCK)
    assert split == vllm_api.hit_sources(3 * BLOCK, BLOCK)
    assert connector.get_external_cache_hit_sources(request, 0) == {}
    connector.shutdown()


# -- hooks left at vLLM's default on purpose -----------------------------------------


def test_the_defaults_left_in_place_are_the_ones_the_connector_needs(tmp_path):
    """vllm_api.py's table of base-class hooks not overridden: each default
    is checked where this vLLM has the hook."""
    cls = NPUKVStoreConnector
    transfer = SimpleNamespace(kv_connector_extra_config={})
    if hasattr(cls, "kv_cache_access"):  # 0.34
        assert cls.kv_cache_access(transfer) == vllm_base.KVCacheAccess.IN_PROCESS
    if hasattr(cls, "supports_lookahead_block_hashes"):  # 0.34
        assert cls.supports_lookahead_block_hashes(transfer) is False
    if hasattr(cls, "supports_sleep_mode"):  # 0.33+
        assert cls.supports_sleep_mode(transfer) is True
    vllm_config, kv_cache_config = hybrid_config(extra=_extra(tmp_path))
    connector = cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    request = make_request("r", list(range(4 * BLOCK + 1)))
    request.kv_transfer_params = None
    if hasattr(cls, "may_load_async"):  # 0.34
        assert connector.may_load_async(request) is False
    if hasattr(cls, "get_mem_pool_context"):  # 0.32+
        assert connector.get_mem_pool_context() is None
    connector.shutdown()
