"""bench_scale's scheduler case: ``SchedulerSide.match`` for a 128k-token
prompt whose every block is stored, with 1, 4 and 16 namespaces (TP 1, 4,
16 under GQA: one namespace per rank), first call and retries.

The scheduler side is the real one (vLLM's config objects as stand-ins with
the attributes it reads, as tests/support/connector.py builds them; vLLM
itself is imported, by the namespace code). Every block of the prompt is
published in every rank's namespace as index records without data files
(``Index.commit_chunk``, 64 rows a chunk): ``match`` looks keys up and asks
the page cache about the chunk files, and reads none.

    first   a new request (its keys hashed, then looked up), median of repeats
    retry   the same request asked again (vLLM asks again on every step it
            cannot schedule it): its keys are kept, the lookups counted by
            wrapping the ``Index`` methods that look keys up
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from bench.harness.processes import in_process
from npukv_store.store.index import Index
from npukv_store.store.index_rows import ChunkRecord

TOKENS = 131072
BLOCK = 128
ROWS = 64  # rows a published chunk
#: ``Index`` methods that look keys up (any name a helper adds that starts so
#: is counted too)
_LOOKUP_PREFIXES = ("lookup", "locate")


def _configs(tp: int) -> tuple[Any, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    transfer = SimpleNamespace(
        kv_connector_extra_config={}, kv_load_failure_policy="fail",
        is_kv_producer=True,
    )  # fmt: skip
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, tensor_parallel_size=tp
        ),
        model_config=SimpleNamespace(model="bench-scale", revision=None, use_mla=False),
        kv_transfer_config=transfer,
        cache_config=SimpleNamespace(enable_prefix_caching=True),
    )
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    layers = ["model.layers.0.self_attn.attn"]
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=layers, kv_cache_spec=spec)],
        kv_cache_layout="LBHNC",
        num_blocks=TOKENS // BLOCK + 8,
    )
    return vllm_config, kv_cache_config


def _request(req_id: str, tokens: list[int]) -> Any:
    return SimpleNamespace(
        request_id=req_id, all_token_ids=tokens, prompt_token_ids=tokens,
        num_tokens=len(tokens), num_prompt_tokens=len(tokens),
        num_computed_tokens=0, lora_request=None, mm_features=[],
        cache_salt=None, prompt_embeds=None,
    )  # fmt: skip


@contextmanager
def counted_lookups() -> Iterator[list[int]]:
    """While open, ``[n]``: the calls made to the ``Index`` lookup methods."""
    count = [0]
    names = [
        n for n in dir(Index)
        if n.startswith(_LOOKUP_PREFIXES) and callable(getattr(Index, n))
    ]  # fmt: skip
    originals = {n: Index.__dict__[n] for n in names if n in Index.__dict__}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counting(*args: Any, **kw: Any) -> Any:
            count[0] += 1
            return fn(*args, **kw)

        return counting

    for name, fn in originals.items():
        setattr(Index, name, wrap(fn))
    try:
        yield count
    finally:
        for name, fn in originals.items():
            setattr(Index, name, fn)


def _publish(side: Any, tokens: list[int], cid: int) -> int:
    """Publish every block of ``tokens`` in each of ``side``'s namespaces as
    chunks numbered from ``cid``; returns the next free id."""
    state = side.chains.new_state(_request("fill", tokens))
    keys = side.chains.keys(state, len(tokens) // BLOCK)
    index: Index = side.store.index
    now = time.time_ns()
    for rank_keys in keys:
        for chain in rank_keys:
            for lo in range(0, len(chain), ROWS):
                rec = ChunkRecord.new(
                    cid, bytes(16), chain[lo : lo + ROWS], 1 << 20, now
                )
                index.commit_chunk(rec, capacity_bytes=1 << 61, grace_ns=0)
                cid += 1
    return cid


def measure(
    cache_dir: str, namespaces: tuple[int, ...], repeats: int, tokens_n: int
) -> dict[str, Any]:
    """Per namespace count: first-call and retry times, lookups per retry."""
    from npukv_store import StoreConfig, parse_size
    from npukv_store.connector.scheduler.side import SchedulerSide

    settings = StoreConfig(cache_dir=cache_dir, ring_size=parse_size("8MiB"))
    tokens = [(i * 7919) % 150_000 for i in range(tokens_n)]
    sides = {tp: SchedulerSide(*_configs(tp), settings) for tp in namespaces}
    try:
        cid = 1
        for tp, side in sides.items():
            if side.disabled_reason:
                raise RuntimeError(f"TP {tp}: scheduler off: {side.disabled_reason}")
            cid = _publish(side, tokens, cid)
        want = (tokens_n - 1) // BLOCK * BLOCK
        first: dict[int, list[float]] = {tp: [] for tp in sides}
        retry: dict[int, list[float]] = {tp: [] for tp in sides}
        lookups: dict[int, int] = {}
        for r in range(repeats):
            for tp, side in sides.items():  # interleaved: drift hits all alike
                request = _request(f"r{tp}-{r}", tokens)
                t0 = time.perf_counter()
                got = side.match(request, 0)
                first[tp].append(time.perf_counter() - t0)
                if got != want:
                    raise RuntimeError(f"TP {tp}: match found {got}, expected {want}")
                with counted_lookups() as count:
                    t0 = time.perf_counter()
                    side.match(request, 0)
                    retry[tp].append(time.perf_counter() - t0)
                lookups[tp] = count[0]
    finally:
        for side in sides.values():
            side.close()
    return {
        str(tp): {
            "namespaces": tp,
            "first_ms": statistics.median(first[tp]) * 1e3,
            "retry_ms": statistics.median(retry[tp]) * 1e3,
            "retry_lookups": lookups[tp],
        }
        for tp in sides
    }


def run_case(cache_dir: str, repeats: int, tokens_n: int = TOKENS) -> dict[str, Any]:
    """In a spawned process: vLLM's import stays out of this one."""
    namespaces = (1, 4, 16)
    args = (cache_dir, namespaces, repeats, tokens_n)
    value = in_process(measure, *args, timeout_s=1800)
    return {"tokens": tokens_n, "block_size": BLOCK, "by_namespaces": value}
