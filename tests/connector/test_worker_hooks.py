"""The worker under the hook patterns real platforms produce, over a real store.

- vllm-ascend calls ``save_kv_layer("", [])`` for linear-attention layers;
- MLA attention on Ascend skips ``wait_for_layer_load`` on decode-only steps
  and calls the hooks from its own direct-call path too (so a layer's hooks
  can fire twice);
- prefetch: with ``prefetch_depth`` d, the reads of the next d-1 layers are
  issued before a layer's wait returns, and with d = 1 none is.

The fake NPU backend (tests/support/ascend.py) is the CPU backend (copies are
memcpys) with the kind "npu", events that only complete when synchronized, and
a compute stream that records what it was made to wait on.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from npukv_store.connector.connector import NPUKVStoreConnector
from npukv_store.connector.metadata import NPUKVMetadata
from npukv_store.connector.worker.loader import LayerLoader
from tests.support.ascend import FakeNpuBackend
from tests.support.connector import (
    LAYERS,
    cpu_caches,
    engine_config,
    transfer,
    worker_for,
)


def fake_npu_worker(tmp_path, caches, **kw):
    """A worker registered on FakeNpuBackend."""
    import npukv_store.device as device

    backend = FakeNpuBackend()
    original = device.get_backend
    device.get_backend = lambda _device: backend
    try:
        worker = worker_for(tmp_path, caches, **kw)
    finally:
        device.get_backend = original
    return worker, backend


def stored_blocks(tmp_path, keys, src_ids, seed=1):
    """Save ``keys`` from blocks ``src_ids`` of a seeded cache; returns it."""
    source = cpu_caches(seed=seed)
    saver = worker_for(tmp_path, source, layerwise="off")
    saver.bind(NPUKVMetadata(saves=[transfer(keys, src_ids)]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()
    return source


# -- vllm-ascend's linear-attention hooks -------------------------------------------


def test_linear_attention_hooks_with_empty_names_are_ignored(tmp_path, caplog):
    """A whole step through the connector, vllm-ascend style: every attention
    layer's hooks, plus ``save_kv_layer("", [])`` and ``wait_for_layer_load("")``
    for linear-attention layers in between. Nothing fails, the chunk holds
    exactly the attention layers, and they load back bit for bit."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vllm_config, kv_cache_config = engine_config(
        extra={"cache_dir": str(tmp_path / "cache"), "ring_size": "8MiB",
               "layerwise": "on"}
    )  # fmt: skip
    source = cpu_caches(seed=11)
    keys = [bytes([90 + i]) * 16 for i in range(3)]
    role = KVConnectorRole.WORKER
    connector = NPUKVStoreConnector(vllm_config, role, kv_cache_config)
    connector.register_kv_caches(source)
    with caplog.at_level(logging.WARNING, logger="npukv_store"):
        connector.bind_connector_metadata(
            NPUKVMetadata(saves=[transfer(keys, [2, 7, 5])])
        )
        connector.start_load_kv(None)
        for name in LAYERS:
            connector.wait_for_layer_load("")  # a linear-attention layer
            connector.save_kv_layer("", [], None)
            connector.wait_for_layer_load(name)
            connector.save_kv_layer(name, source[name], None)
        connector.save_kv_layer("", [], None)
        connector.wait_for_save()
        connector.clear_connector_metadata()
    # warnings and errors only: the INFO lines of the store's first open
    # ("rebuilt index") reach caplog where vLLM's import left the level at INFO
    warned = [
        r for r in caplog.records
        if r.name.startswith("npukv_store") and r.levelno >= logging.WARNING
    ]  # fmt: skip
    assert warned == []
    store = connector._worker.store
    assert store.flush(timeout_s=30)
    assert store.stats().num_blocks == 3
    connector.shutdown()

    from safetensors import safe_open

    (chunk,) = (tmp_path / "cache").glob("*/chunks/*.safetensors")
    with safe_open(str(chunk), "np") as f:
        pages = {name for name in f.keys() if name.endswith(".page")}  # noqa: SIM118
    assert pages == {f"{name}.page" for name in LAYERS}
    target = cpu_caches(seed=12)
    loader = worker_for(tmp_path, target, layerwise="off")
    loader.bind(NPUKVMetadata(loads=[transfer(keys, [9, 10, 11])]))
    loader.start_load()
    loader.save_layer("")
    loader.finish_step()
    assert loader.take_load_errors() == set()
    for name in LAYERS:
        torch.testing.assert_close(target[name][[9, 10, 11]], source[name][[2, 7, 5]])
    loader.close()


# -- MLA on Ascend: decode steps without wait, hooks from two paths ------------------


def attention_step(worker, meta, *, waits: bool, twice: bool = False) -> None:
    """One forward as an Ascend MLA model runs it: bind, sync loads before the
    forward, per layer (wait) attention (save), wait_for_save."""
    worker.bind(meta)
    worker.start_load()
    for name in LAYERS:
        for _ in range(2 if twice else 1):  # the decorator and the direct call
            if waits:
                worker.wait_layer(name)
            worker.save_layer(name)
    worker.finish_step()


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_mla_ascend_hook_pattern_loads_complete_fenced_and_verified(tmp_path, mode):
    """Steps: a prefill without loads (auto learns the hooks here), a load
    step whose hooks fire from both paths, a decode-only step that skips
    wait_for_layer_load, then a load step again with one corrupt row. Every
    load is copied, fenced before the next step (its events synchronized, the
    compute stream ordered after each layer) and verified (the corrupt row is
    a load error, its neighbours are not)."""
    keys = [bytes([120 + i]) * 16 for i in range(6)]
    source = stored_blocks(tmp_path, keys, [3, 4, 5, 6, 7, 8])
    (chunk,) = (tmp_path / "cache").glob("*/chunks/*.safetensors")
    target = cpu_caches(seed=13)
    worker, backend = fake_npu_worker(tmp_path, target, layerwise=mode)

    attention_step(worker, NPUKVMetadata(), waits=True)  # prefill, nothing to load
    assert worker.layerwise is True  # auto: every hook fired on an "npu"

    attention_step(
        worker, NPUKVMetadata(loads=[transfer(keys[:3], [20, 21, 22])]),
        waits=True, twice=True,
    )  # fmt: skip
    assert worker.loads.job is None  # settled inside its own step
    assert worker.take_load_errors() == set()
    load_events = [e for e in backend.events if e in backend.compute.waited]
    assert load_events
    assert all(e.synchronized for e in load_events)
    for name in LAYERS:
        torch.testing.assert_close(target[name][[20, 21, 22]], source[name][[3, 4, 5]])

    attention_step(worker, NPUKVMetadata(), waits=False)  # decode-only step
    assert worker.layerwise is True  # no load was pending: nothing to fall back from

    data = bytearray(chunk.read_bytes())
    data[-8 * 3 * 6 - 1] ^= 0xFF  # last data byte: key 5, last layer
    chunk.write_bytes(bytes(data))
    waited_before = len(backend.compute.waited)
    attention_step(
        worker, NPUKVMetadata(loads=[transfer(keys[3:], [25, 26, 27])]), waits=True
    )
    assert worker.take_load_errors() == {27}
    assert len(backend.compute.waited) - waited_before >= len(LAYERS)
    assert all(e.synchronized for e in backend.compute.waited)
    for name in LAYERS:
        torch.testing.assert_close(target[name][[25, 26]], source[name][[6, 7]])
    worker.close()


def test_a_skipped_wait_on_a_load_step_is_recomputed_not_served(tmp_path):
    """The same pattern with a load pending on a step that skips the waits
    (what must never be taken as a decode-only step): the blocks are load
    errors and the worker falls back to bulk loads."""
    keys = [bytes([140 + i]) * 16 for i in range(2)]
    stored_blocks(tmp_path, keys, [3, 4])
    worker, _ = fake_npu_worker(tmp_path, cpu_caches(seed=14), layerwise="on")
    attention_step(worker, NPUKVMetadata(loads=[transfer(keys, [9, 10])]), waits=False)
    assert worker.take_load_errors() == {9, 10}
    assert worker.layerwise is False
    worker.close()


# -- prefetch depth ------------------------------------------------------------------

# reads faster than the forward's layers: without the window, reads would run
# ahead of a slow forward whatever the depth
READ_DELAY_S = 0.08
COMPUTE_S = 0.3


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_prefetch_depth_bounds_the_reads_ahead_of_the_forward(tmp_path, depth):
    """A store whose every layer read takes READ_DELAY_S, a forward that
    computes COMPUTE_S per layer after its wait. With depth d the reads of
    layers i+1 .. i+d-1 are issued before layer i's wait returns; layer i+d's
    never is; with d = 1 no read runs ahead of the forward."""
    keys = [bytes([160 + i]) * 16 for i in range(4)]
    source = stored_blocks(tmp_path, keys, [1, 2, 3, 4])
    target = cpu_caches(seed=15)
    worker, backend = fake_npu_worker(
        tmp_path, target, layerwise="on", prefetch_depth=depth
    )
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    store = worker.stores[0]
    read = store.read

    def slow_read(keys_, out):
        (name,) = out
        with lock:
            events.append(("issue", worker.layer_index[name.removesuffix(".page")]))
        time.sleep(READ_DELAY_S)
        return read(keys_, out)

    store.read = slow_read
    loader: LayerLoader = worker.loader
    job = loader.new_job([keys], [[10, 11, 12, 13]], gated=True)

    def returned(event) -> None:  # inside wait_layer, before it opens the window
        with lock:
            events.append(("returned", job.done.index(event)))

    backend.compute.on_wait = returned
    loader.submit(job)
    for index in range(len(LAYERS)):
        loader.wait_layer(job, index)
        time.sleep(COMPUTE_S)
    loader.settle(job)
    assert job.errors == set()
    for name in LAYERS:
        torch.testing.assert_close(target[name][10:14], source[name][1:5])
    position = {event: i for i, event in enumerate(events)}
    for i in range(len(LAYERS)):
        for k in range(1, len(LAYERS) - i):
            ahead = position[("issue", i + k)] < position[("returned", i)]
            assert ahead is (k < depth), (depth, i, k, events)
    worker.close()
