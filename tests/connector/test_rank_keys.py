"""Every rank's keys come from one chain per KV cache group (decision 0061):
the scheduler side, the store's own ``keys_for`` and the workers' saves and
loads agree on them, with one namespace and with several."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from npukv_store import KVStore
from npukv_store.connector.metadata import NPUKVMetadata
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.vllm_api import ManagerBlockIds
from npukv_store.connector.worker import side as worker_module
from npukv_store.connector.worker.side import WorkerSide
from npukv_store.hashing import chain_root, namespace_fingerprint
from tests.support.connector import (
    BLOCK,
    LAYERS,
    cpu_caches,
    engine_config,
    hybrid_config,
    make_request,
    settings,
)

BLOCKS = 5
TOKENS = list(range(1000, 1000 + BLOCKS * BLOCK + 3))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_scheduler_and_store_derive_the_same_keys(tmp_path, tp):
    cfg = settings(tmp_path)
    side = SchedulerSide(*engine_config(tp=tp), cfg)
    keys = side._keys(side._state(make_request("r", TOKENS)), BLOCKS)
    side.close()
    for rank in range(tp):
        spec = side.engine.specs[rank][0]
        with KVStore(cfg, spec) as store:
            assert store.keys_for(TOKENS) == keys[rank][0]
        assert chain_root(spec) == namespace_fingerprint(side.engine.specs[0][0])
    # rank 0's keys are the chain; no two ranks share a key
    assert len({key for rank in keys for key in rank[0]}) == tp * BLOCKS


def test_hybrid_groups_have_a_chain_each(tmp_path):
    side = SchedulerSide(*hybrid_config(), settings(tmp_path))
    ((sliding, full),) = side._keys(side._state(make_request("r", TOKENS)), BLOCKS)
    side.close()
    assert not set(sliding) & set(full)
    assert side.chains.roots == side.fingerprints[0]


def _worker(tmp_path, monkeypatch, tp: int, rank: int, caches) -> WorkerSide:
    monkeypatch.setattr(worker_module, "_tp_rank", lambda: rank)
    worker = WorkerSide(*engine_config(tp=tp), settings(tmp_path))
    worker.register(caches)
    assert worker.disabled_reason == ""
    assert worker.rank == rank
    return worker


def _run_step(worker: WorkerSide, meta: NPUKVMetadata) -> None:
    worker.bind(meta)
    worker.start_load()
    for name in LAYERS:
        worker.wait_layer(name)
        worker.save_layer(name)
    worker.finish_step()


@pytest.mark.parametrize("tp", [1, 3])
def test_what_every_rank_saves_is_found_and_loaded(tmp_path, monkeypatch, tp):
    """The workers save with the keys the scheduler sends; a later request's
    lookup finds every rank's blocks, and each rank loads its own bytes."""
    side = SchedulerSide(*engine_config(tp=tp), settings(tmp_path))
    ids = list(range(1, BLOCKS + 2))
    side.block_ids = ManagerBlockIds(SimpleNamespace(get_block_ids=lambda rid: (ids,)))
    first = make_request("a", TOKENS)
    assert side.match(first, 0) == 0
    side.allocated(first, (ids,), 0)
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"a": len(TOKENS)}))
    assert [len(s.block_ids) for s in meta.saves] == [BLOCKS]
    sources = [cpu_caches(seed=10 + rank) for rank in range(tp)]
    for rank in range(tp):
        saver = _worker(tmp_path, monkeypatch, tp, rank, sources[rank])
        _run_step(saver, meta)
        assert saver.store is not None
        assert saver.store.flush(timeout_s=30)
        saver.close()
    side.finished(first)

    second = make_request("b", TOKENS)
    assert side.match(second, 0) == BLOCKS * BLOCK  # every rank stores all 5
    targets = list(range(20, 20 + BLOCKS + 1))
    side.allocated(second, (targets,), BLOCKS * BLOCK)
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"b": 3}))
    assert len(meta.loads) == 1
    for rank in range(tp):
        caches = cpu_caches(seed=99)
        loader = _worker(tmp_path, monkeypatch, tp, rank, caches)
        _run_step(loader, meta)
        assert loader.take_load_errors() == set()
        for name in LAYERS:
            torch.testing.assert_close(
                caches[name][targets[:BLOCKS]], sources[rank][name][ids[:BLOCKS]]
            )
        loader.close()
    side.close()
