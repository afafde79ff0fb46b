"""bench_scale's host cases: the disk bytes of an MLA hit loaded by 4 TP
workers, and a worker's peak RSS and /dev/shm at TP 4 and TP 16.

MLA reads: ``bench/mla_reads.py``'s ``measure`` (4 spawned processes load
the same cold MLA chunks; the sum of their ``/proc/self/io`` read_bytes over
the hit's bytes).

Host memory: one spawned process per TP plays one worker of a Qwen3-235B
engine (94 layers, 4 KV heads of 128, bf16: one namespace per rank) with
the default settings: it opens the store and makes its staging ring as a
worker does at registration (``prepare_async`` with the ring the connector
would ask for, ``store/sizing.py``, where that exists; the configured
``ring_size`` otherwise). Its peak RSS (``ru_maxrss``) and the bytes its
ring holds in /dev/shm are per process; times TP for the engine.
"""

from __future__ import annotations

import importlib
import inspect
import os
import resource
import tempfile
from typing import Any

from bench.harness.processes import in_process
from npukv_store import KVStore, StoreConfig

#: Qwen3-235B-A22B's config.json, the fields the KV cache depends on
QWEN3_235B = {
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "hidden_size": 4096, "torch_dtype": "bfloat16",
}  # fmt: skip


def mla_reads(root: str, gib: float, rounds: int) -> dict[str, Any]:
    """``bench/mla_reads.py``'s measure with 4 workers."""
    mod = importlib.import_module("bench.mla_reads")
    kwargs: dict[str, Any] = {"workers": 4, "gib": gib, "rounds": rounds}
    params = inspect.signature(mod.measure).parameters
    return dict(mod.measure(root, **{k: v for k, v in kwargs.items() if k in params}))


def _one_worker(cache_dir: str, tp: int, batched_tokens: int) -> dict[str, Any]:
    from npukv_store.store import model_shape, sizing

    config = StoreConfig(cache_dir=cache_dir)
    shape = model_shape.ModelShape.from_hf_config(QWEN3_235B, name="qwen3-235b")
    spec = shape.rank_specs(tp, 128)[0]
    request = sizing.ring_request([spec], batched_tokens, config.chunk_target_size, tp)
    with KVStore(config, spec) as store:
        store.prepare_async(request)
        ring = store._async.ring if store._async is not None else None  # no public view
        shm = os.stat(ring.path).st_blocks * 512 if ring is not None else 0
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "tp": tp,
            "ring_bytes": ring.size if ring is not None else 0,
            "shm_bytes_per_process": shm,
            "peak_rss_bytes_per_process": peak_rss,
            "shm_bytes_per_engine": shm * tp,
            "ring_size_setting": config.ring_size,
            "batched_tokens": batched_tokens,
        }


def host_memory(root: str, batched_tokens: int) -> dict[str, Any]:
    """Per TP (4, 16): one worker's peak RSS and /dev/shm, in its own process."""
    rows = {}
    for tp in (4, 16):
        cache_dir = tempfile.mkdtemp(prefix=f"tp{tp}-", dir=root)
        rows[str(tp)] = in_process(
            _one_worker, cache_dir, tp, batched_tokens, timeout_s=600
        )
    return rows
