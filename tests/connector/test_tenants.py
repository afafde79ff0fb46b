"""Tenants through the connector (docs/decisions/0067): the scheduler names
each request's tenant by its cache salt, and a worker's step writes one
chunk per tenant, so that eviction can take one tenant's blocks without
another's."""

from __future__ import annotations

from types import SimpleNamespace

from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.vllm_api import ManagerBlockIds
from npukv_store.keying import DEFAULT_TENANT
from tests.support.connector import (
    BLOCK,
    LAYERS,
    cpu_caches,
    engine_config,
    make_request,
    settings,
    worker_for,
)


def test_the_scheduler_tags_each_save_with_its_requests_tenant(tmp_path):
    side = SchedulerSide(*engine_config(), settings(tmp_path))
    assert side.store is not None
    ids = {"a": list(range(10, 14)), "b": list(range(20, 24)), "c": list(range(30, 34))}
    side.block_ids = ManagerBlockIds(
        SimpleNamespace(get_block_ids=lambda rid: (ids[rid],))
    )
    salts = {"a": "tenant-a", "b": None, "c": "tenant-c"}
    for rid, salt in salts.items():
        tokens = [hash((rid, i)) % 3000 for i in range(3 * BLOCK + 1)]
        request = make_request(rid, tokens, salt=salt)
        side.match(request, 0)
        side.allocated(request, (ids[rid],), 0)
    meta = side.build_meta(
        SimpleNamespace(num_scheduled_tokens=dict.fromkeys(salts, 3 * BLOCK + 1))
    )
    tenants = {save.req_id: save.tenant for save in meta.saves}
    assert tenants == {rid: side.store.tenant(salt) for rid, salt in salts.items()}
    assert tenants["b"] == DEFAULT_TENANT
    assert len(set(tenants.values())) == 3
    side.close()


def test_a_worker_step_writes_one_chunk_per_tenant(tmp_path):
    saver = worker_for(tmp_path, cpu_caches(seed=1), layerwise="off")
    store = saver.store
    assert store is not None
    tenant_a, tenant_b = store.tenant("a"), store.tenant("b")
    saves = [
        BlockTransfer(
            "r1", [3, 4], [bytes([1]) * 16 + bytes([2]) * 16], tenant=tenant_a
        ),
        BlockTransfer("r2", [5], [bytes([3]) * 16], tenant=tenant_b),
        BlockTransfer("r3", [6], [bytes([4]) * 16], tenant=tenant_a),
    ]
    saver.bind(NPUKVMetadata(saves=saves))
    for name in LAYERS:
        saver.wait_layer(name)
        saver.save_layer(name)
    saver.finish_step()
    assert store.flush(timeout_s=30)
    chunks = {r.tenant: len(r.keys) for r in store.index.iter_chunks()}
    assert chunks == {tenant_a: 3, tenant_b: 1}
    ledger, _ = store.index.tenants()
    assert set(ledger) == {tenant_a, tenant_b}
    assert store.check() == []  # the headers name the same tenants
    saver.close()
