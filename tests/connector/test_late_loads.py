"""vLLM 0.30+ calls start_load_kv *after* the forward unless the step's
SchedulerOutput.has_sync_kv_loads is set (kv_connector_model_runner_mixin).

- asynchronous loads stay correct and asynchronous when started late;
- the scheduler side sets the flag for its synchronous loads (a scheduler
  such as vllm-ascend 0.30's balance scheduler builds SchedulerOutput
  without it);
- a synchronous load that a worker is still asked to start after the
  forward loads nothing: its blocks are load errors, which vLLM recomputes.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.scheduler.side import SchedulerSide
from tests.support.connector import (
    BLOCK,
    LAYERS,
    NUM_BLOCKS,
    cpu_caches,
    engine_config,
    make_request,
    put_blocks,
    received,
    settings,
    transfer,
    worker_for,
)

SRC_IDS = [3, 17, 4]
DST_IDS = [20, 21, 9]
KEYS = [bytes([i + 1]) * 16 for i in range(3)]


def _stored(tmp_path) -> dict[str, torch.Tensor]:
    """KEYS saved from SRC_IDS of a source worker's caches."""
    source = cpu_caches(seed=1)
    saver = worker_for(tmp_path, source)
    saver.bind(NPUKVMetadata(saves=[transfer(KEYS, SRC_IDS)]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()
    return source


def _forward(worker) -> None:
    """The step's attention layers, in order, with their connector hooks."""
    for name in LAYERS:
        worker.wait_layer(name)
        worker.save_layer(name)


@pytest.mark.parametrize("layerwise", ["on", "off"])
def test_asynchronous_loads_started_after_the_forward_are_byte_exact(
    tmp_path, layerwise
):
    source = _stored(tmp_path)
    target = cpu_caches(seed=2)
    before = {name: t.clone() for name, t in target.items()}
    loader = worker_for(tmp_path, target, layerwise=layerwise)
    late = BlockTransfer("r", DST_IDS, [b"".join(KEYS)], asynchronous=True)
    loader.bind(NPUKVMetadata(loads=[late]))
    _forward(loader)  # vLLM 0.30+: the forward first ...
    loader.start_load()  # ... then start_load_kv ...
    loader.finish_step()  # ... then wait_for_save
    assert received(loader, "r") == set()
    assert loader.take_load_errors() == set()
    others = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    for name in LAYERS:
        torch.testing.assert_close(target[name][DST_IDS], source[name][SRC_IDS])
        torch.testing.assert_close(target[name][others], before[name][others])
    loader.close()


@pytest.mark.parametrize("layerwise", ["on", "off"])
def test_a_synchronous_load_started_after_the_forward_is_recomputed(
    tmp_path, layerwise, caplog
):
    _stored(tmp_path)
    target = cpu_caches(seed=2)
    before = {name: t.clone() for name, t in target.items()}
    loader = worker_for(tmp_path, target, layerwise=layerwise)
    loader.bind(NPUKVMetadata(loads=[transfer(KEYS, DST_IDS)]))
    _forward(loader)
    with caplog.at_level(logging.WARNING, logger="npukv_store"):
        loader.start_load()
    loader.finish_step()
    assert loader.take_load_errors() == set(DST_IDS)
    assert "after its forward" in caplog.text
    for name in LAYERS:  # nothing written under a forward that already ran
        torch.testing.assert_close(target[name], before[name])

    # the next step, in the usual order, loads
    loader.bind(NPUKVMetadata(loads=[transfer(KEYS, DST_IDS)]))
    loader.start_load()
    _forward(loader)
    loader.finish_step()
    assert loader.take_load_errors() == set()
    assert not torch.equal(target[LAYERS[0]][DST_IDS], before[LAYERS[0]][DST_IDS])
    loader.close()


# -- the scheduler asks vLLM for the early start --------------------------------------


def _scheduler_with_a_hit(tmp_path):
    vllm_config, kv_cache_config = engine_config()
    side = SchedulerSide(vllm_config, kv_cache_config, settings(tmp_path))
    tokens = list(range(3 * BLOCK + 1))
    ((keys,),) = side._keys(side._state(make_request("r", tokens)), 3)
    put_blocks(settings(tmp_path), side.engine.specs[0][0], keys)
    request = make_request("r", tokens)
    assert side.match(request, 0) == 3 * BLOCK
    block_ids = ([5, 6, 7, 8],)
    side.allocated(request, block_ids, 3 * BLOCK)
    return side


@pytest.mark.parametrize("flag", [False, True])
def test_a_step_with_a_synchronous_load_asks_for_loads_before_the_forward(
    tmp_path, flag
):
    side = _scheduler_with_a_hit(tmp_path)
    output = SimpleNamespace(
        num_scheduled_tokens={"r": 1},
        has_sync_kv_loads=flag,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
        finished_req_ids=set(),
    )
    meta = side.build_meta(output)
    assert [t.asynchronous for t in meta.loads] == [False]
    assert output.has_sync_kv_loads is True
    side.close()


def test_a_step_without_synchronous_loads_leaves_the_late_start(tmp_path):
    side = _scheduler_with_a_hit(tmp_path)
    output = SimpleNamespace(
        num_scheduled_tokens={"other": 1},  # the hit's request is not scheduled
        has_sync_kv_loads=False,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
        finished_req_ids=set(),
    )
    meta = side.build_meta(output)
    assert meta.loads == []
    assert output.has_sync_kv_loads is False
    side.close()


# -- errors asked for before wait_for_save (a speculator's deferred finalize) ---------


def test_layerwise_load_errors_reach_vllm_before_wait_for_save(tmp_path):
    """With a speculator, vLLM 0.30+ collects get_block_ids_with_load_errors
    after the target forward and before wait_for_save (defer_finalize): the
    failed blocks of the layers the forward waited on are reported then, with
    the step's output, and not again after wait_for_save."""
    _stored(tmp_path)
    loader = worker_for(tmp_path, cpu_caches(seed=2), layerwise="on")
    missing = b"\x77" * 16
    loader.bind(NPUKVMetadata(loads=[transfer([*KEYS[:2], missing], DST_IDS)]))
    loader.start_load()
    _forward(loader)
    assert loader.take_load_errors() == {DST_IDS[2]}  # before wait_for_save
    loader.finish_step()
    assert loader.take_load_errors() == set()  # reported once
    loader.close()
