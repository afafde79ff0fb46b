"""The connector's Prometheus metrics, on vLLM's ``/metrics`` as ``vllm:npukv_*``.

Runs in: the process that runs vLLM's stat loggers (the API server's, or the
engine's in offline mode). vLLM builds this once per server
(``build_prom_metrics``) and hands it, per scheduler step, the connector's
stats of that step summed over workers (``NPUKVStats.data``).

    counters    vllm:npukv_{hit_tokens,lookup_tokens,loaded_bytes,saved_bytes,
                dropped_blocks,load_errors,loaded_blocks,saved_blocks,
                declined_tokens}_total, admission's
                vllm:npukv_{declined_blocks,lost_hit_blocks,
                wasted_write_blocks}_total (per engine; per tenant: npukv stats), and
                vllm:npukv_load_decisions_total{decision=load|shorter|recompute|probe}
    histograms  vllm:npukv_load_gbps, vllm:npukv_save_gbps (one sample per step
                that loaded or saved), vllm:npukv_load_wait_seconds (per step
                whose forward waited for loads: the slowest worker's wait),
                vllm:npukv_remote_wait_seconds (per step that asked the tier)
    gauge       vllm:npukv_ring_used_bytes (staging ring held by unpublished saves),
                vllm:npukv_remote_up (the remote tier answers: 1, or 0)
    remote      vllm:npukv_remote_*_total: the remote tier's hits, lookups,
                puts, loads and failures (docs/metrics.md)

The names and their meaning are in docs/metrics.md, with the Grafana
dashboard docs/grafana_npukv.json.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
)

from npukv_store.connector.vllm_api import create_metric_per_engine

#: stats key -> what the counter counts (its name is vllm:npukv_<key>_total)
COUNTED = {
    "lookup_tokens": "Prompt tokens the connector looked up in the store.",
    "hit_tokens": "Prompt tokens the connector found stored (claimed for loading).",
    "loaded_blocks": "Blocks loaded from the store into the KV cache.",
    "loaded_bytes": "Bytes loaded from the store into the KV cache.",
    "saved_blocks": "Blocks saved to the store.",
    "saved_bytes": "Bytes saved to the store.",
    "dropped_blocks": "Blocks whose save was dropped (ring full or disk failing).",
    "load_errors": "Blocks whose load failed and were recomputed.",
    "declined_tokens": "Hit tokens the load policy chose to recompute (their "
    "load was expected to be slower).",
    "declined_blocks": "Blocks a save brought that admission did not write "
    "(second sight's first sight, or the write budget spent).",
    "lost_hit_blocks": "Blocks a save brought again after admission declined "
    "them (a hit the store could have served).",
    "wasted_write_blocks": "Blocks written and then evicted before any read "
    "(counted by the process whose commit evicted them).",
    "remote_hit_tokens": "Hit tokens found in the remote tier beyond the local "
    "store (claimed for loading).",
    "remote_lookups": "batch_is_exist calls the scheduler made to the remote tier.",
    "remote_failures": "Remote-tier calls that failed or hung (each may open "
    "the circuit breaker).",
    "remote_put_blocks": "Blocks written to the remote tier.",
    "remote_put_bytes": "Bytes written to the remote tier.",
    "remote_put_full": "Blocks the remote tier refused for lack of space.",
    "remote_put_failed": "Blocks whose remote put failed.",
    "remote_put_dropped": "Blocks not put because the tier was down or behind.",
    "remote_load_blocks": "Blocks loaded from the remote tier, verified.",
    "remote_load_bytes": "Bytes loaded from the remote tier, verified.",
    "remote_load_missing": "Remote blocks gone when loaded (recomputed).",
    "remote_load_corrupt": "Remote values that failed verification (recomputed).",
    "remote_load_mac_failed": (
        "Remote values whose MAC failed: forged, or put by a node of another "
        "secret (recomputed; also counted in remote_load_corrupt)."
    ),
    "remote_load_errors": "Remote blocks whose load failed otherwise (recomputed).",
}
#: the load policy's decisions, by the label value each is counted under
DECIDED = {
    "load": "decided_load",
    "shorter": "decided_shorter",
    "recompute": "decided_recompute",
    "probe": "decided_probe",
}
#: GB/s buckets: a page-cache hit runs at 5-15 GB/s, NVMe at 1-7, a busy disk below
_GBPS_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
#: seconds a step's forward waits for its loads: 1 ms (a warm short prefix)
#: to seconds (a long cold one on a busy disk)
_WAIT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


#: stats key -> (kind, documentation, buckets) of the metrics of one value
#: each (named vllm:npukv_<key>): a histogram takes each positive value, a
#: gauge is set whenever the key is sent
MEASURED: dict[str, tuple[str, str, list[float] | None]] = {
    "load_wait_seconds": (
        "histogram",
        "Seconds a step's forward waited for its loads "
        "(per step that loaded; the slowest worker).",
        _WAIT_BUCKETS,
    ),
    "remote_wait_seconds": (
        "histogram",
        "Seconds a scheduler step spent asking the "
        "remote tier (per step that asked; bounded by remote_timeout_ms).",
        _WAIT_BUCKETS,
    ),
    "ring_used_bytes": (
        "gauge",
        "Bytes of the staging rings held by saves not yet "
        "on disk (the largest over workers).",
        None,
    ),
    "remote_up": (
        "gauge",
        "1 while the remote tier answers, 0 while its "
        "circuit breaker is open (sent when it changes).",
        None,
    ),
}
#: (what, bytes key, seconds key) of the bandwidth histograms vllm:npukv_<what>_gbps
RATES = (
    ("load", "loaded_bytes", "load_seconds"),
    ("save", "saved_bytes", "save_seconds"),
)


class NPUKVPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:npukv_*`` metrics of one server (one child per engine)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = per_engine_labelvalues
        # vLLM types these as a union of metric classes; each is one class here
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        gauge: Any = self._gauge_cls
        self.counters: dict[str, dict[int, Any]] = {}
        for key, doc in COUNTED.items():
            metric = counter(
                name=f"vllm:npukv_{key}", documentation=doc, labelnames=labelnames
            )
            self.counters[key] = create_metric_per_engine(metric, engines)
        self.rates: dict[tuple[str, str], dict[int, Any]] = {}
        for what, nbytes, seconds in RATES:
            metric = histogram(
                name=f"vllm:npukv_{what}_gbps",
                documentation=f"{what.title()} bandwidth per step that {what}ed "
                "blocks, in GB/s (bytes over the time the step's transfers took).",
                buckets=_GBPS_BUCKETS,
                labelnames=labelnames,
            )
            self.rates[nbytes, seconds] = create_metric_per_engine(metric, engines)
        self.histograms: dict[str, dict[int, Any]] = {}
        self.gauges: dict[str, dict[int, Any]] = {}
        for key, (kind, doc, buckets) in MEASURED.items():
            name = f"vllm:npukv_{key}"
            if kind == "histogram":
                metric = histogram(
                    name=name, documentation=doc, buckets=buckets, labelnames=labelnames
                )
                self.histograms[key] = create_metric_per_engine(metric, engines)
            else:
                metric = gauge(
                    name=name, documentation=doc, labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )  # fmt: skip
                self.gauges[key] = create_metric_per_engine(metric, engines)
        decisions = counter(
            name="vllm:npukv_load_decisions",
            documentation="The load policy's decisions on hits: load (all of "
            "it), shorter (its page-cached head), recompute (none), probe (all, "
            "to measure, although recompute looked faster).",
            labelnames=[*labelnames, "decision"],
        )
        self.decisions: dict[int, dict[str, Any]] = {
            idx: {d: decisions.labels(*values, d) for d in DECIDED}
            for idx, values in engines.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for key, metric in self.counters.items():
            value = data.get(key, 0)
            if value:
                metric[engine_idx].inc(value)
        for (nbytes, seconds), metric in self.rates.items():
            if data.get(seconds, 0) > 0 and data.get(nbytes, 0) > 0:
                metric[engine_idx].observe(data[nbytes] / data[seconds] / 1e9)
        for decision, key in DECIDED.items():
            if data.get(key, 0):
                self.decisions[engine_idx][decision].inc(data[key])
        for key, metric in self.histograms.items():
            if data.get(key, 0) > 0:
                metric[engine_idx].observe(data[key])
        for key, metric in self.gauges.items():
            if key in data:
                metric[engine_idx].set(data[key])
