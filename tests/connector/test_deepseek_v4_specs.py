"""DeepSeek V4 on vLLM 0.32's CPU build, without its forward: the KV cache
groups vLLM itself makes for the tiny V4 (bench/harness/tiny_models.py), fed
to the connector's scheduler side, which turns itself off with one line.

The groups come from vLLM's own code, in a child process (it initialises
torch.distributed): the model is built on the meta device (no kernel runs,
no AMX needed), each KV cache layer's ``get_kv_cache_spec`` is asked, and
vLLM's ``get_kv_cache_configs`` groups them, as EngineCore does. For the tiny
V4 (layers: sliding window, C4A with the indexer, C128A) that is six groups:
the three sliding-window caches (SlidingWindowMLASpec, blocks of 64), the
compressed MLA and indexer caches (MLAAttentionSpec, blocks of 256,
tokens_per_state 4 and 128), and the compressors' states (blocks of 4 and 8).
The connector classifies group by group, so the first group it refuses is
the compressed one (group 3): one KV row per ``tokens_per_state`` tokens,
before it would get to the several block sizes.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.harness.processes import child_env, python_module
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.vllm_api import VLLM_VERSION
from tests.support.connector import engine_config, settings

pytest.importorskip("transformers", reason="building the model needs transformers")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not VLLM_VERSION.startswith("0.32."),
        reason=f"the groups asserted are vLLM 0.32's DeepSeek V4 (vllm/models/"
        f"deepseek_v4); this lane runs vLLM {VLLM_VERSION}",
    ),
]

MODULE = "tests.connector.test_deepseek_v4_specs"


def vllm_groups(work: Path) -> list:
    """The KV cache groups vLLM 0.32 makes for the tiny DeepSeek V4, built in
    a child process (:func:`_dump_groups`)."""
    from bench.harness import tiny_models

    facts = tiny_models.build("deepseek_v4", str(work / "model"))
    out = work / "groups.pkl"
    proc = subprocess.run(
        python_module(MODULE, facts["model"], facts["tokenizer"], str(out)),
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1"
        ),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out, "rb") as f:
        return pickle.load(f)


def test_vllms_v4_groups_turn_the_connector_off_naming_compressed_mla(tmp_path, caplog):
    groups = vllm_groups(tmp_path)
    summary = [
        (type(_first(g.kv_cache_spec)).__name__, _first(g.kv_cache_spec).block_size)
        for g in groups
    ]
    assert summary == [
        ("SlidingWindowMLASpec", 64),
        ("SlidingWindowMLASpec", 64),
        ("SlidingWindowMLASpec", 64),
        ("MLAAttentionSpec", 256),
        ("SlidingWindowMLASpec", 4),
        ("SlidingWindowMLASpec", 8),
    ], summary
    assert list(groups[3].layer_names) == [
        "model.layers.1.attn.indexer.k_cache",
        "model.layers.1.attn",
        "model.layers.2.attn",
    ]
    caplog.set_level(logging.WARNING)
    stand_ins = [
        SimpleNamespace(layer_names=g.layer_names, kv_cache_spec=g.kv_cache_spec)
        for g in groups
    ]
    config = engine_config(mla=True, groups=stand_ins)
    scheduler = SchedulerSide(*config, settings(tmp_path))
    needle = (
        "KV cache group 3 is MLAAttentionSpec (3 layer(s), e.g. "
        "model.layers.1.attn.indexer.k_cache): tokens_per_state=4, expected 1"
    )
    assert needle in scheduler.disabled_reason, scheduler.disabled_reason
    assert "\n" not in scheduler.disabled_reason
    assert scheduler.engine is None  # off: nothing matched, nothing saved
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    off = [line for line in lines if "the connector is off" in line]
    assert len(off) == 1, lines
    assert needle in off[0], off[0]
    assert "DeepSeek V4" in off[0], off[0]
    assert not any(r.exc_info for r in caplog.records)  # no traceback


def _first(kv_spec):
    """A group's spec, or its first layer's (UniformTypeKVCacheSpecs)."""
    per_layer = getattr(kv_spec, "kv_cache_specs", None)
    return next(iter(per_layer.values())) if per_layer else kv_spec


def _dump_groups(model: str, tokenizer: str, out: str) -> None:
    """In a child process: vLLM's KV cache groups for ``model``, as EngineCore
    forms them (prefix caching on, as vLLM keeps it where the CPU has AMX),
    pickled to ``out``."""
    import torch
    import vllm.v1.worker.worker_base as worker_base
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.cpu_model_runner import _torch_cuda_wrapper

    args = EngineArgs(
        model=model, tokenizer=tokenizer, dtype="bfloat16", block_size=256,
        enforce_eager=True, max_model_len=1024, enable_prefix_caching=True,
    )  # fmt: skip
    config = args.create_engine_config()

    class _Event:  # the layers make CUDA events they never use on CPU
        def __init__(self, *args, **kwargs) -> None:
            pass

    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:0", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
        from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM

        cuda_event, torch.cuda.Event = torch.cuda.Event, _Event
        try:
            with torch.device("meta"), _torch_cuda_wrapper():
                DeepseekV4ForCausalLM(vllm_config=config)
        finally:
            torch.cuda.Event = cuda_event
        backends = worker_base.get_current_attn_backends(config)
    specs = {
        name: spec
        for name, layer in config.compilation_config.static_forward_context.items()
        if isinstance(layer, AttentionLayerBase)
        and (spec := layer.get_kv_cache_spec(config)) is not None
    }
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(config, [layouts], list(specs.values()))
    # vLLM turns prefix caching off for V4 where the CPU has no AMX
    config.cache_config.enable_prefix_caching = True
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [1 << 30])
    with open(out, "wb") as f:
        pickle.dump(list(kv_cache_config.kv_cache_groups), f)


if __name__ == "__main__":
    _dump_groups(*sys.argv[1:4])
