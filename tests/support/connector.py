"""The connector's two halves without an engine: vLLM's config objects and
requests as stand-ins with the attributes the connector reads, CPU KV caches
laid out as vLLM's CPU backend lays them out, and a worker on them.

Imports torch (and vLLM where called): only the connector's tests use it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from npukv_store import KVStore, StoreConfig
from npukv_store.connector.metadata import BlockTransfer
from npukv_store.connector.worker.side import WorkerSide

BLOCK = 16
HEADS, HEAD_DIM = 2, 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
NUM_BLOCKS = 32
#: a hybrid model's layers (hybrid_config)
LAYERS4 = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
WINDOW = 2 * BLOCK  # a hit at block e needs blocks e-2, e-1 of the window group
PAGE = HEADS * BLOCK * 2 * HEAD_DIM * 4  # fused K|V, fp32


def engine_config(
    *,
    tp: int = 1,
    mla: bool = False,
    extra: dict | None = None,
    prefix_caching: bool = True,
    groups: list | None = None,
):
    """vLLM's config objects as the connector reads them; ``groups``: the KV
    cache groups (default: one full-attention group of LAYERS)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    transfer = SimpleNamespace(
        kv_connector_extra_config=extra or {},
        kv_load_failure_policy="fail",
        is_kv_producer=True,
    )
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, tensor_parallel_size=tp
        ),
        model_config=SimpleNamespace(model="tiny-llama", revision=None, use_mla=mla),
        kv_transfer_config=transfer,
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    if groups is None:
        groups = [SimpleNamespace(layer_names=LAYERS, kv_cache_spec=spec)]
    kv_cache_config = SimpleNamespace(
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
        num_blocks=NUM_BLOCKS,
    )
    return vllm_config, kv_cache_config


def make_request(req_id: str, tokens: list[int], salt: str | None = None):
    return SimpleNamespace(
        request_id=req_id,
        all_token_ids=list(tokens),
        prompt_token_ids=list(tokens),
        num_tokens=len(tokens),
        num_prompt_tokens=len(tokens),
        num_computed_tokens=0,
        lora_request=None,
        mm_features=[],
        cache_salt=salt,
        prompt_embeds=None,
    )


def settings(tmp_path, **kw) -> StoreConfig:
    return StoreConfig(cache_dir=str(tmp_path / "cache"), ring_size="8MiB", **kw)


def cpu_caches(seed: int) -> dict[str, torch.Tensor]:
    """One shared buffer, per-layer [B, H, N, 2D] views (vLLM's CPU layout)."""
    gen = torch.Generator().manual_seed(seed)
    numel = NUM_BLOCKS * HEADS * BLOCK * 2 * HEAD_DIM
    shared = torch.randn(len(LAYERS) * numel, generator=gen)
    return {
        name: shared[i * numel : (i + 1) * numel].view(
            NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM
        )
        for i, name in enumerate(LAYERS)
    }


def put_blocks(cfg: StoreConfig, spec, keys: list[bytes]) -> None:
    with KVStore(cfg, spec) as store:
        rows = {
            f"{layer.name}.page": np.zeros((len(keys), PAGE), np.uint8)
            for layer in spec.layers
        }
        store.put(keys, rows)


def worker_for(tmp_path, caches, **kw) -> WorkerSide:
    worker = WorkerSide(*engine_config(), settings(tmp_path, **kw))
    worker.register(caches)
    assert worker.disabled_reason == ""
    return worker


def transfer(keys: list[bytes], block_ids: list[int]) -> BlockTransfer:
    return BlockTransfer("r", block_ids, [b"".join(keys)])


def attention_spec(window: int | None = None):
    """vLLM's spec of a full-attention layer, or of a sliding-window one of
    ``window`` tokens."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
    )
    if window is None:
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(**common, sliding_window=window)


def hybrid_config(**kw):
    """Gemma-like: layers 0 and 2 slide, 1 and 3 attend to everything."""
    groups = [
        SimpleNamespace(
            layer_names=LAYERS4[0::2], kv_cache_spec=attention_spec(WINDOW)
        ),
        SimpleNamespace(layer_names=LAYERS4[1::2], kv_cache_spec=attention_spec()),
    ]
    return engine_config(groups=groups, **kw)


def received(worker: WorkerSide, req_id: str, timeout_s: float = 30.0) -> set[str]:
    """Wait until ``worker`` reports the asynchronous load of ``req_id``
    received; the failed loads reported with it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, recving, failed = worker.transfer_results()
        if req_id in recving:
            return set(failed)
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never reported as received")
