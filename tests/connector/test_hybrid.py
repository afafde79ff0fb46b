"""Hybrid models (vLLM's hybrid KV cache manager on): a sliding-window group
and a full-attention group, each its own namespace, through both halves of
the connector without an engine (the real-vLLM runs are tests/e2e).

The hits and loads here are those of vLLM 0.32+, which takes a failed load
of several groups back per request: on vLLM 0.23 the scheduler only saves
(tests/connector/test_vllm_api.py), so these tests force the 0.32 path there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    MambaSpec,
)

from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.namespace import engine_namespaces
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.vllm_api import ManagerBlockIds
from npukv_store.connector.worker.side import WorkerSide
from npukv_store.hashing import namespace_fingerprint
from tests.support.connector import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    LAYERS4,
    NUM_BLOCKS,
    WINDOW,
    attention_spec,
    engine_config,
    hybrid_config,
    make_request,
    put_blocks,
    received,
    settings,
)


@pytest.fixture(autouse=True)
def _vllm_takes_failed_loads_back(monkeypatch):
    from npukv_store.connector.scheduler import side as scheduler

    monkeypatch.setattr(scheduler, "REPORTS_FAILED_LOADS", True)


def hybrid_caches(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen)
        for name in LAYERS4
    }


# -- namespaces ------------------------------------------------------------------


def test_group_structure_is_part_of_every_namespace(tmp_path):
    """The same layers as one full group (HMA off), as two groups (HMA on),
    or as one sliding group: no two namespaces are the same."""
    cfg = settings(tmp_path)
    layouts = {
        "hma_off": engine_config(
            groups=[
                SimpleNamespace(layer_names=LAYERS4, kv_cache_spec=attention_spec())
            ]
        ),
        "hma_on": hybrid_config(),
        "all_sliding": engine_config(
            groups=[
                SimpleNamespace(
                    layer_names=LAYERS4, kv_cache_spec=attention_spec(WINDOW)
                )
            ]
        ),
        "other_window": engine_config(
            groups=[
                SimpleNamespace(layer_names=LAYERS4, kv_cache_spec=attention_spec(96))
            ]
        ),
    }
    prints = []
    for vllm_config, kv_cache_config in layouts.values():
        engine = engine_namespaces(vllm_config, kv_cache_config, cfg)
        prints += [namespace_fingerprint(spec) for spec in engine.specs[0]]
    assert len(prints) == 5
    assert len(set(prints)) == 5
    engine = engine_namespaces(*hybrid_config(), cfg)
    assert [g.kind for g in engine.groups] == ["sliding", "full"]
    assert engine.groups[0].tail_tokens == WINDOW - 1
    assert engine.hybrid


def test_mamba_group_turns_both_halves_off_with_one_message(tmp_path, caplog):
    """A Mamba group outside vLLM's align mode (prefix caching off: one
    running state per request, no boundary states) is refused; align mode is
    tests/connector/test_state_groups.py."""
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    groups = [
        SimpleNamespace(
            layer_names=["model.layers.0.linear_attn"], kv_cache_spec=mamba
        ),
        SimpleNamespace(layer_names=LAYERS4[1:], kv_cache_spec=attention_spec()),
    ]
    vllm_config, kv_cache_config = engine_config(groups=groups)
    side = SchedulerSide(vllm_config, kv_cache_config, settings(tmp_path))
    assert "KV cache group 0 is MambaSpec" in side.disabled_reason
    assert side.match(make_request("r", list(range(5 * BLOCK))), 0) == 0
    assert side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 9})).saves == []
    worker = WorkerSide(vllm_config, kv_cache_config, settings(tmp_path))
    worker.register(hybrid_caches(0))
    assert worker.disabled_reason == side.disabled_reason
    errors = [r for r in caplog.records if r.name.startswith("npukv_store")]
    assert len(errors) == 1  # the scheduler's line; the worker stays quiet
    side.close()
    worker.close()


# -- scheduler --------------------------------------------------------------------


def test_hit_needs_the_window_tail_and_loads_asynchronously(tmp_path):
    cfg = settings(tmp_path)
    side = SchedulerSide(*hybrid_config(), cfg)
    assert side.load_async
    tokens = list(range(6 * BLOCK + 3))
    request = make_request("r", tokens)
    keys = side._keys(side._state(request), 6)
    sliding_spec, full_spec = side.engine.specs[0]
    put_blocks(cfg, full_spec, keys[0][1][:5])  # the full group stores 5 blocks
    put_blocks(cfg, sliding_spec, keys[0][0][4:5])  # the window group only block 4
    assert side.match(request, 0) == 0  # a hit at 5 also needs block 3
    put_blocks(cfg, sliding_spec, keys[0][0][1:3])
    request = make_request("r", tokens)  # a retry would reuse the first answer
    assert side.match(request, 0) == 3 * BLOCK  # at 3: blocks 1, 2 stored
    assert side.match(request, 2 * BLOCK) == 1 * BLOCK  # beyond a local hit
    put_blocks(cfg, sliding_spec, keys[0][0][3:4])
    request = make_request("r", tokens)
    assert side.match(request, 0) == 5 * BLOCK
    # vLLM allocates null blocks (0) below the window of the hit's end
    sliding_ids, full_ids = [0, 0, 0, 31, 32, 33, 34], [11, 12, 13, 14, 15, 16, 17]
    side.allocated(request, (sliding_ids, full_ids), 5 * BLOCK)
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    loads = {load.group: load for load in meta.loads}
    assert all(load.asynchronous for load in meta.loads)  # unscheduled, still sent
    assert loads[0].block_ids == [31, 32]
    assert loads[0].keys(0) == keys[0][0][3:5]
    assert loads[1].block_ids == [11, 12, 13, 14, 15]
    side.close()


@pytest.mark.parametrize("policy", ["all", "tails"])
def test_saves_per_group_skip_null_blocks_and_keep_tails(tmp_path, policy):
    side = SchedulerSide(*hybrid_config(), settings(tmp_path, sliding_save=policy))
    request = make_request("r", list(range(6 * BLOCK + 5)))  # 6 full blocks
    sliding_ids = [40, 41, 42, 43, 44, 45, 46]
    full_ids = [50, 51, 52, 53, 54, 55, 56]
    side.block_ids = ManagerBlockIds(
        SimpleNamespace(get_block_ids=lambda rid: (sliding_ids, full_ids))
    )
    side.match(request, 0)
    side.allocated(request, (sliding_ids, full_ids), 0)
    sliding_ids[:2] = [0, 0]  # vLLM freed them before the step that saves
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 6 * BLOCK + 5}))
    saves = {save.group: save for save in meta.saves}
    assert saves[1].block_ids == full_ids[:6]
    if policy == "all":
        assert saves[0].block_ids == [42, 43, 44, 45]  # every non-null block
    else:  # the tail a hit at the prompt's end (block 6) needs
        assert saves[0].block_ids == [44, 45]
    assert not any(save.asynchronous for save in meta.saves)
    side.close()


# -- worker ---------------------------------------------------------------------------


def _transfer(group, keys, block_ids, *, asynchronous=False, req="r"):
    return BlockTransfer(req, block_ids, [b"".join(keys)], group=group,
                         asynchronous=asynchronous)  # fmt: skip


def test_worker_saves_each_group_and_loads_them_asynchronously(tmp_path):
    vllm_config, kv_cache_config = hybrid_config()
    source = hybrid_caches(1)
    saver = WorkerSide(vllm_config, kv_cache_config, settings(tmp_path))
    saver.register(source)
    assert len(saver.stores) == 2  # one namespace per group, one ring
    slide_keys = [bytes([1, i]) * 8 for i in range(2)]
    full_keys = [bytes([2, i]) * 8 for i in range(4)]
    saver.bind(NPUKVMetadata(saves=[
        _transfer(0, slide_keys, [7, 8]), _transfer(1, full_keys, [3, 4, 5, 6]),
    ]))  # fmt: skip
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    counts = [store.stats().num_blocks for store in saver.stores]
    assert counts == [6, 6]  # one shared index: both handles see every block
    saver.close()

    target = hybrid_caches(2)
    loader = WorkerSide(vllm_config, kv_cache_config, settings(tmp_path))
    loader.register(target)
    loader.bind(NPUKVMetadata(loads=[
        _transfer(0, slide_keys, [20, 21], asynchronous=True),
        _transfer(1, full_keys, [22, 23, 24, 25], asynchronous=True),
    ]))  # fmt: skip
    loader.start_load()
    loader.finish_step()
    assert received(loader, "r") == set()
    for name in LAYERS4[0::2]:
        torch.testing.assert_close(target[name][[20, 21]], source[name][[7, 8]])
    for name in LAYERS4[1::2]:
        torch.testing.assert_close(target[name][22:26], source[name][3:7])

    missing = [b"\x77" * 16]
    loader.bind(NPUKVMetadata(loads=[
        _transfer(1, missing, [30], asynchronous=True, req="bad"),
        _transfer(1, full_keys[:1], [29], asynchronous=True, req="good"),
    ]))  # fmt: skip
    loader.start_load()
    loader.finish_step()
    assert received(loader, "bad") == {"bad"}
    # never block ids: vLLM cannot map them back with several groups
    assert loader.take_load_errors() == set()
    loader.close()


def test_an_async_load_that_cannot_be_planned_is_reported_failed(tmp_path):
    """vLLM waits for every asynchronous load it was promised: when planning
    one fails in update_state_after_alloc, the workers still report it
    received and failed, so vLLM recomputes it instead of waiting for ever."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from npukv_store.connector.connector import NPUKVStoreConnector

    vllm_config, kv_cache_config = hybrid_config(
        extra={"cache_dir": str(tmp_path / "cache"), "ring_size": "8MiB"}
    )
    connector = NPUKVStoreConnector(
        vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    request = make_request("r", list(range(4 * BLOCK + 1)))
    connector.get_num_new_matched_tokens(request, 0)
    broken = SimpleNamespace(get_block_ids=lambda: 1 / 0)
    connector.update_state_after_alloc(request, broken, 4 * BLOCK)
    meta = connector._scheduler.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert meta.failed_loads == ["r"]
    assert not meta.is_empty()
    connector.shutdown()

    worker = WorkerSide(vllm_config, kv_cache_config, settings(tmp_path))
    worker.register(hybrid_caches(3))
    worker.bind(meta)
    worker.start_load()
    worker.finish_step()
    assert worker.transfer_results()[1:] == ({"r"}, {"r"})
    assert worker.transfer_results()[1:] == (set(), set())  # reported once
    worker.close()
