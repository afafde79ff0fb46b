"""The connector's Prometheus metrics (connector/prometheus.py): what vLLM's
stat logger calls, checked in a registry of the test's own."""

from __future__ import annotations

import functools

import prometheus_client  # a dependency of vLLM's
import pytest

from npukv_store.connector.connector import NPUKVStoreConnector
from npukv_store.connector.stats import NPUKVStats


@pytest.fixture
def metrics():
    registry = prometheus_client.CollectorRegistry()
    bound = {
        kind: functools.partial(kind, registry=registry)
        for kind in (
            prometheus_client.Counter,
            prometheus_client.Gauge,
            prometheus_client.Histogram,
        )
    }
    types = {kind: bound[kind] for kind in bound}

    class Config:
        kv_transfer_config = None

    built = NPUKVStoreConnector.build_prom_metrics(
        Config(), types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}
    )
    return built, registry


def _value(registry, name, engine="0"):
    return registry.get_sample_value(name, {"model_name": "m", "engine": engine})


def test_counters_move_with_the_steps_stats(metrics):
    prom, registry = metrics
    step = NPUKVStats()
    step.add(hit_tokens=64, lookup_tokens=96, loaded_bytes=2 << 20, load_seconds=0.002,
             saved_bytes=3 << 20, save_seconds=0.003, dropped_blocks=2,
             load_errors=1)  # fmt: skip
    prom.observe(step.to_dict(), engine_idx=0)
    prom.observe(step.to_dict(), engine_idx=0)
    assert _value(registry, "vllm:npukv_hit_tokens_total") == 128
    assert _value(registry, "vllm:npukv_lookup_tokens_total") == 192
    assert _value(registry, "vllm:npukv_loaded_bytes_total") == 4 << 20
    assert _value(registry, "vllm:npukv_saved_bytes_total") == 6 << 20
    assert _value(registry, "vllm:npukv_dropped_blocks_total") == 4
    assert _value(registry, "vllm:npukv_load_errors_total") == 2
    assert _value(registry, "vllm:npukv_hit_tokens_total", engine="1") == 0
    # one sample per step: (2 MiB / 2 ms) = 1.05 GB/s lands in the 2 GB/s bucket
    assert _value(registry, "vllm:npukv_load_gbps_count") == 2
    sample = {"model_name": "m", "engine": "0", "le": "1.0"}
    assert registry.get_sample_value("vllm:npukv_load_gbps_bucket", sample) == 0
    sample["le"] = "2.0"
    assert registry.get_sample_value("vllm:npukv_load_gbps_bucket", sample) == 2


def test_admission_counters_advance_by_each_steps_blocks(metrics):
    prom, registry = metrics
    step = NPUKVStats()
    step.add(declined_blocks=5, lost_hit_blocks=2, wasted_write_blocks=1,
             saved_bytes=4096)  # fmt: skip
    prom.observe(step.to_dict(), engine_idx=0)
    later = NPUKVStats()
    later.add(declined_blocks=3)
    prom.observe(later.to_dict(), engine_idx=0)
    prom.observe(later.to_dict(), engine_idx=1)
    assert _value(registry, "vllm:npukv_declined_blocks_total") == 8
    assert _value(registry, "vllm:npukv_lost_hit_blocks_total") == 2
    assert _value(registry, "vllm:npukv_wasted_write_blocks_total") == 1
    assert _value(registry, "vllm:npukv_saved_bytes_total") == 4096
    assert _value(registry, "vllm:npukv_declined_blocks_total", engine="1") == 3
    assert _value(registry, "vllm:npukv_wasted_write_blocks_total", engine="1") == 0
    # the load policy's declined hit tokens are another counter
    assert _value(registry, "vllm:npukv_declined_tokens_total") == 0


def test_a_step_without_transfers_records_no_rate_and_the_gauge_follows(metrics):
    prom, registry = metrics
    prom.observe(NPUKVStats().to_dict())
    assert _value(registry, "vllm:npukv_load_gbps_count") == 0
    assert _value(registry, "vllm:npukv_save_gbps_count") == 0
    assert _value(registry, "vllm:npukv_ring_used_bytes") == 0
    busy = NPUKVStats({"ring_used_bytes": 5 << 20})
    prom.observe(busy.to_dict())
    assert _value(registry, "vllm:npukv_ring_used_bytes") == 5 << 20
    prom.observe(NPUKVStats({"ring_used_bytes": 0}).to_dict())
    assert _value(registry, "vllm:npukv_ring_used_bytes") == 0


def test_the_ring_gauge_is_the_peak_over_workers_and_makes_stats_non_empty():
    one = NPUKVStats({"ring_used_bytes": 4096})
    two = NPUKVStats({"ring_used_bytes": 8192})
    assert not one.is_empty()
    assert one.aggregate(two).data["ring_used_bytes"] == 8192
    assert NPUKVStats().aggregate(NPUKVStats()).data.get("ring_used_bytes") is None
    assert NPUKVStats().is_empty()


def test_the_dashboard_and_the_docs_name_only_metrics_that_exist(metrics):
    import json
    import re
    from pathlib import Path

    _, registry = metrics
    exposed = {
        sample.name for family in registry.collect() for sample in family.samples
    }
    docs = Path(__file__).resolve().parents[2] / "docs"
    dashboard = json.loads((docs / "grafana_npukv.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = set(re.findall(r"vllm:npukv_\w+", " ".join(exprs)))
    named |= set(re.findall(r"vllm:npukv_\w+", (docs / "metrics.md").read_text()))
    # a histogram is named by its family in the docs: its _bucket series exists
    missing = {n for n in named if n not in exposed and f"{n}_bucket" not in exposed}
    assert missing == set()
    assert len(named) >= 8


def test_decisions_are_counted_by_label_and_the_load_wait_per_step(metrics):
    prom, registry = metrics
    step = NPUKVStats()
    step.add(decided_load=3, decided_recompute=2, declined_tokens=64)
    step.peak("load_wait_seconds", 0.004)
    prom.observe(step.to_dict(), engine_idx=0)
    prom.observe(NPUKVStats().to_dict(), engine_idx=0)  # no load: no wait sample

    def decided(decision, engine="0"):
        labels = {"model_name": "m", "engine": engine, "decision": decision}
        return registry.get_sample_value("vllm:npukv_load_decisions_total", labels)

    assert (decided("load"), decided("recompute"), decided("shorter")) == (3, 2, 0)
    assert decided("load", engine="1") == 0
    assert _value(registry, "vllm:npukv_declined_tokens_total") == 64
    assert _value(registry, "vllm:npukv_load_wait_seconds_count") == 1
    sample = {"model_name": "m", "engine": "0", "le": "0.0025"}
    assert registry.get_sample_value("vllm:npukv_load_wait_seconds_bucket", sample) == 0
    sample["le"] = "0.005"
    assert registry.get_sample_value("vllm:npukv_load_wait_seconds_bucket", sample) == 1


def test_the_load_wait_of_a_step_is_the_slowest_workers():
    one = NPUKVStats()
    one.peak("load_wait_seconds", 0.010)
    two = NPUKVStats()
    two.peak("load_wait_seconds", 0.030)
    assert one.aggregate(two).data["load_wait_seconds"] == 0.030
    assert not NPUKVStats({"load_wait_seconds": 0.01}).is_empty()
