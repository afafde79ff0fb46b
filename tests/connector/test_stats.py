"""NPUKVStats (vLLM's KVConnectorStats): aggregation across workers and steps,
reduce(), the trip through vLLM's KVConnectorLogging, and the worker's
periodic log line against a run whose bytes are known."""

from __future__ import annotations

import logging
import pickle

import pytest

from npukv_store.connector.metadata import NPUKVMetadata
from npukv_store.connector.stats import COUNTERS, NPUKVStats
from npukv_store.connector.worker import side as worker_module
from tests.support.connector import (
    LAYERS,
    PAGE,
    cpu_caches,
    transfer,
    worker_for,
)


def stats(**counts: float) -> NPUKVStats:
    out = NPUKVStats()
    out.add(**counts)
    return out


def test_aggregate_sums_workers_and_steps_and_reduce_adds_rates():
    # two TP workers, two steps each, then the scheduler's own counters
    rank0 = [stats(loaded_blocks=3, loaded_bytes=3e9, load_seconds=1.0),
             stats(saved_blocks=2, saved_bytes=1e9, save_seconds=0.5)]  # fmt: skip
    rank1 = [stats(loaded_blocks=3, loaded_bytes=1e9, load_seconds=1.0),
             stats(dropped_blocks=4, load_errors=1)]  # fmt: skip
    scheduler = stats(lookup_tokens=400, hit_tokens=100)
    total = NPUKVStats()
    for step in rank0 + rank1 + [scheduler]:
        total = total.aggregate(step)
    reduced = total.reduce()
    assert reduced["loaded_blocks"] == 6
    assert reduced["dropped_blocks"] == 4
    assert reduced["load_errors"] == 1
    # bytes over the seconds spent loading, summed over workers: the
    # per-worker bandwidth (2 GB/s here), not the engine's aggregate
    assert reduced["load_GBps"] == pytest.approx(2.0)
    assert reduced["save_GBps"] == pytest.approx(2.0)
    assert reduced["hit_rate"] == pytest.approx(0.25)
    assert set(COUNTERS) <= set(reduced)
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()
    assert total.reduce()["load_GBps"] == 0.0  # no division by zero


def test_stats_survive_pickling_and_vllms_logging_path():
    """Workers' stats are pickled to the scheduler, which hands the dict to
    KVConnectorLogging; it rebuilds them with build_kv_connector_stats."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
    )

    sent = pickle.loads(pickle.dumps(stats(saved_blocks=5, saved_bytes=5000)))
    assert sent.data["saved_blocks"] == 5
    logging_ = KVConnectorLogging(
        KVTransferConfig(
            kv_connector="NPUKVStoreConnector",
            kv_connector_module_path="npukv_store.connector",
            kv_role="kv_both",
        )
    )
    logging_.observe(sent.data)
    logging_.observe(stats(saved_blocks=1, saved_bytes=1000).data)
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert line.startswith("KV Transfer metrics: ")
    assert "saved_blocks=6" in line
    assert "saved_bytes=6000" in line
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # reset after each interval


def test_worker_stats_and_periodic_line_count_a_known_run(
    tmp_path, caplog, monkeypatch
):
    """Save 5 blocks, then load 4 of them and 1 that is not stored: the step
    stats and the periodic log line give exactly those numbers."""
    monkeypatch.setattr(worker_module, "_LOG_INTERVAL_S", 0.0)
    keys = [bytes([200 + i]) * 16 for i in range(5)]
    saver = worker_for(tmp_path, cpu_caches(seed=21), layerwise="off")
    saver.bind(NPUKVMetadata(saves=[transfer(keys, [1, 2, 3, 4, 5])]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saved = saver.take_stats()
    assert saved is not None
    assert saved.data["saved_blocks"] == 5
    assert saved.data["saved_bytes"] == 5 * len(LAYERS) * PAGE
    assert saved.data["dropped_blocks"] == 0
    assert saver.take_stats() is None  # nothing new since
    saver.close()

    loader = worker_for(tmp_path, cpu_caches(seed=22), layerwise="off")
    missing = b"\xee" * 16
    loader.bind(
        NPUKVMetadata(loads=[transfer([*keys[:4], missing], [9, 10, 11, 12, 13])])
    )
    loader.start_load()
    with caplog.at_level(logging.INFO, logger="npukv_store"):
        loader.finish_step()
    step = loader.take_stats()
    assert step is not None
    assert step.data["loaded_blocks"] == 4
    assert step.data["loaded_bytes"] == 4 * len(LAYERS) * PAGE
    assert step.data["load_errors"] == 1
    assert step.data["load_seconds"] > 0
    (line,) = [
        r.getMessage() for r in caplog.records if "rank 0: loaded" in r.getMessage()
    ]
    assert "loaded 4 blocks" in line
    assert "saved 0 blocks, dropped 0, load errors 1" in line
    loader.close()


def test_worker_stats_carry_the_stores_admission_counters(tmp_path):
    """Under second sight a save's blocks are declined the first time and
    written the second (lost hits): each step's stats carry the store's
    counters' growth, once."""
    keys = [bytes([150 + i]) * 16 for i in range(3)]
    saver = worker_for(
        tmp_path, cpu_caches(seed=31), layerwise="off", admission="second_sight"
    )
    assert saver.store is not None
    for blocks in ([1, 2, 3], [4, 5, 6]):
        saver.bind(NPUKVMetadata(saves=[transfer(keys, blocks)]))
        saver.finish_step()
        assert saver.store.flush(timeout_s=30)
    first = saver.take_stats()
    assert first is not None
    assert first.data["declined_blocks"] == 3
    assert first.data["lost_hit_blocks"] == 3
    assert first.data["saved_blocks"] == 3
    assert saver.take_stats() is None  # nothing new since
    saver.store.counters.add(wasted_write_blocks=2)
    later = saver.take_stats()
    assert later is not None
    assert later.data["wasted_write_blocks"] == 2
    assert later.data["declined_blocks"] == 0
    saver.close()
