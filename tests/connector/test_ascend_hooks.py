"""vllm-ascend's MLA steps that call no wait_for_layer_load, over a real store.

vllm-ascend's MLA attention waits for a layer's load only when the step has a
prefill, and counts every request of at most 1 + num_speculative_tokens
tokens as a decode. A full-prefix hit leaves one token to compute, so the step
that loads it calls no wait hook. The worker predicts such steps from the
metadata (``max_request_tokens``) and loads them in bulk inside
start_load_kv: every layer fenced before attention, verified, and layerwise
stays on. A step predicted to wait that skips a wait is still recomputed and
turns layerwise off, and GQA (whose waits run every step) is not predicted,
unless decode batches replay full graphs (xlite's FULL_DECODE_ONLY).

The fake NPU backend (tests/support/ascend.py): the CPU backend with
the kind "npu", events complete only once synchronized.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from npukv_store.connector.metadata import NPUKVMetadata
from npukv_store.connector.worker.ascend_rules import SkippedWaits
from tests.support.ascend import (
    NOPE,
    ROPE,
    FakeNpuBackend,
    ascend_mla,
    make_worker,
)
from tests.support.connector import (
    BLOCK,
    LAYERS,
    NUM_BLOCKS,
    cpu_caches,
    engine_config,
    transfer,
)

KEYS = [bytes([200 + i]) * 16 for i in range(6)]
SOURCE_IDS = [3, 4, 5, 6, 7, 8]


def mla_caches(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """vllm-ascend's MLA value: (nope, rope), separate allocations
    (model_runner_v1.py:4606-4627)."""
    gen = torch.Generator().manual_seed(seed)

    def part(dim: int) -> torch.Tensor:
        x = torch.randn(NUM_BLOCKS, BLOCK, 1, dim, generator=gen)
        return x.to(torch.bfloat16)

    return {name: (part(NOPE), part(ROPE)) for name in LAYERS}


def mla_config(speculative: int = 0):
    vllm_config, kv_cache_config = engine_config(
        mla=True,
        groups=[SimpleNamespace(layer_names=LAYERS, kv_cache_spec=ascend_mla())],
    )
    if speculative:
        vllm_config.speculative_config = SimpleNamespace(
            num_speculative_tokens=speculative
        )
    return vllm_config, kv_cache_config


def store_blocks(tmp_path, config, source, keys, block_ids) -> None:
    """``keys`` saved from ``block_ids`` of ``source`` (CPU, bulk), flushed."""
    saver = make_worker(tmp_path, config, source, layerwise="off")
    saver.bind(NPUKVMetadata(saves=[transfer(keys, block_ids)]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()


def store_mla_blocks(tmp_path):
    """KEYS saved from SOURCE_IDS of a seeded MLA cache."""
    source = mla_caches(seed=1)
    store_blocks(tmp_path, mla_config(), source, KEYS, SOURCE_IDS)
    return source


def step(worker, backend, meta, *, waits: bool) -> bool:
    """One MLA forward as vllm-ascend runs it; returns whether every layer's
    load was fenced (the compute stream made to wait on it) before the first
    attention ran."""
    worker.bind(meta)
    before = len(backend.compute.waited) if backend is not None else 0
    worker.start_load()
    fenced = (
        backend is not None
        and bool(meta.loads)
        and len(backend.compute.waited) - before == len(LAYERS)
        and worker.loads.job is None
    )
    for name in LAYERS:
        if waits:
            worker.wait_layer(name)
        worker.save_layer(name)
    worker.finish_step()
    return fenced


def assert_loaded(target, source, dst, src) -> None:
    for name in LAYERS:
        for part in (0, 1):  # nope, rope: bit for bit
            assert torch.equal(target[name][part][dst], source[name][part][src])


def test_a_full_prefix_hit_step_without_waits_loads_fenced_and_stays_layerwise(
    tmp_path,
):
    """A layerwise MLA worker on an "npu". Step 1: a full-prefix hit (one
    token scheduled) and no wait hook: every layer fenced inside
    start_load_kv, bit-exact, no load error, layerwise still on. Step 2: a
    prefill with its wait hooks: loaded layer by layer, still layerwise.
    Step 3: step 1 again with a corrupt row: that block alone is an error
    (verified)."""
    source = store_mla_blocks(tmp_path)
    (chunk,) = (tmp_path / "cache").glob("*/chunks/*.safetensors")
    target = mla_caches(seed=2)
    backend = FakeNpuBackend()
    worker = make_worker(tmp_path, mla_config(), target, backend, layerwise="on")

    meta = NPUKVMetadata(loads=[transfer(KEYS[:2], [20, 21])], max_request_tokens=1)
    assert step(worker, backend, meta, waits=False)
    assert worker.take_load_errors() == set()
    assert worker.layerwise is True
    assert all(e.synchronized for e in backend.compute.waited)
    assert_loaded(target, source, [20, 21], [3, 4])

    submitted = []
    submit = worker.loader.submit
    worker.loader.submit = lambda job, **kw: (submitted.append(job), submit(job, **kw))
    meta = NPUKVMetadata(loads=[transfer(KEYS[2:4], [22, 23])], max_request_tokens=40)
    assert not step(worker, backend, meta, waits=True)  # fenced by the waits
    assert len(submitted) == 1  # a layerwise job, waited layer by layer
    assert worker.take_load_errors() == set()
    assert worker.layerwise is True
    assert_loaded(target, source, [22, 23], [5, 6])

    data = bytearray(chunk.read_bytes())
    data[-8 * 6 * 3 - 1] ^= 0xFF  # last data byte: key 5, last layer
    chunk.write_bytes(bytes(data))
    meta = NPUKVMetadata(loads=[transfer(KEYS[4:], [24, 25])], max_request_tokens=1)
    assert step(worker, backend, meta, waits=False)
    assert worker.take_load_errors() == {25}
    assert worker.layerwise is True
    assert len(submitted) == 1  # in bulk again
    assert_loaded(target, source, [24], [7])
    worker.close()


@pytest.mark.parametrize(
    ("speculative", "tokens", "skipped_is_safe"),
    [
        (0, 1, True),  # the full-prefix hit
        (0, 2, False),  # a prefill: vllm-ascend waits, the worker need not fence
        (2, 3, True),  # 1 + 2 draft tokens: still a decode there
        (2, 4, False),
        (0, 0, True),  # the scheduler did not say: fenced, to be safe
    ],
)
def test_the_skip_rule_follows_the_decode_threshold(
    tmp_path, speculative, tokens, skipped_is_safe
):
    """A step that skips every wait: served when the metadata says it may
    (at most 1 + num_speculative_tokens per request, or unknown); otherwise
    the old fallback: its blocks are recomputed and layerwise turns off."""
    source = store_mla_blocks(tmp_path)
    target = mla_caches(seed=3)
    backend = FakeNpuBackend()
    config = mla_config(speculative)
    worker = make_worker(tmp_path, config, target, backend, layerwise="on")
    meta = NPUKVMetadata(loads=[transfer(KEYS[:2], [9, 10])], max_request_tokens=tokens)
    step(worker, backend, meta, waits=False)
    if skipped_is_safe:
        assert worker.take_load_errors() == set()
        assert worker.layerwise is True
        assert_loaded(target, source, [9, 10], [3, 4])
    else:
        assert worker.take_load_errors() == {9, 10}
        assert worker.layerwise is False
    worker.close()


def test_gqa_steps_are_never_predicted_to_skip(tmp_path):
    """GQA on Ascend waits in vLLM's decorator every step: a one-token load
    step that skips the waits there is the fallback's, not the rule's."""
    keys = KEYS[:2]
    store_blocks(tmp_path, engine_config(), cpu_caches(seed=4), keys, [3, 4])
    backend = FakeNpuBackend()
    worker = make_worker(
        tmp_path, engine_config(), cpu_caches(seed=5), backend, layerwise="on"
    )
    meta = NPUKVMetadata(loads=[transfer(keys, [9, 10])], max_request_tokens=1)
    step(worker, backend, meta, waits=False)
    assert worker.take_load_errors() == {9, 10}
    assert worker.layerwise is False
    worker.close()


@pytest.mark.parametrize(
    ("mode", "skipped_is_safe"), [("FULL_DECODE_ONLY", True), ("PIECEWISE", False)]
)
def test_decode_graphs_skip_every_models_waits(tmp_path, mode, skipped_is_safe):
    """xlite's FULL_DECODE_ONLY replays decode batches as full graphs, which
    run no hook: a GQA step of decode-sized requests is then fenced in
    start_load_kv too. Under PIECEWISE graphs GQA's waits run."""
    from vllm.config.compilation import CUDAGraphMode

    keys = KEYS[:2]
    source = cpu_caches(seed=7)
    store_blocks(tmp_path, engine_config(), source, keys, [3, 4])
    config = engine_config()
    config[0].compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode])
    backend = FakeNpuBackend()
    target = cpu_caches(seed=8)
    worker = make_worker(tmp_path, config, target, backend, layerwise="on")
    meta = NPUKVMetadata(loads=[transfer(keys, [9, 10])], max_request_tokens=1)
    assert step(worker, backend, meta, waits=False) is skipped_is_safe
    if skipped_is_safe:
        assert worker.take_load_errors() == set()
        assert worker.layerwise is True
        for name in LAYERS:
            assert torch.equal(target[name][[9, 10]], source[name][[3, 4]])
    else:
        assert worker.take_load_errors() == {9, 10}
        assert worker.layerwise is False
    worker.close()


def test_the_rule_is_the_npus_only(tmp_path):
    """On another device (here the CPU, whose MLA attention is vLLM's own and
    waits every step) a skipped wait is the fallback's too."""
    store_mla_blocks(tmp_path)
    worker = make_worker(tmp_path, mla_config(), mla_caches(seed=6), layerwise="on")
    assert worker.backend.kind == "cpu"
    meta = NPUKVMetadata(loads=[transfer(KEYS[:2], [9, 10])], max_request_tokens=1)
    step(worker, None, meta, waits=False)
    assert worker.take_load_errors() == {9, 10}
    assert worker.layerwise is False
    worker.close()


def test_skipped_waits_reads_mla_and_draft_tokens_from_the_config():
    vllm_config, _ = mla_config(speculative=3)
    assert SkippedWaits.from_config(vllm_config) == SkippedWaits(True, 4)
    vllm_config, _ = engine_config()
    vllm_config.speculative_config = None
    assert SkippedWaits.from_config(vllm_config) == SkippedWaits(False, 1, False)
