"""The connector's two halves without a running engine: vLLM's config objects
and requests are stand-ins with the attributes the connector reads, the KV
caches are CPU tensors laid out as vLLM's CPU backend lays them out.

The real-vLLM runs are in tests/e2e; these cover what a CPU engine cannot run
(TP > 1, MLA) and the worker's data path step by step.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from npukv_store.connector.connector import NPUKVStoreConnector
from npukv_store.connector.metadata import NPUKVMetadata
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.vllm_api import ManagerBlockIds
from npukv_store.connector.worker.side import WorkerSide
from tests.support.connector import (
    BLOCK,
    HEAD_DIM,
    LAYERS,
    NUM_BLOCKS,
    cpu_caches,
    engine_config,
    make_request,
    put_blocks,
    settings,
    transfer,
    worker_for,
)

# -- scheduler side -------------------------------------------------------------


def test_tp_hit_needs_every_rank(tmp_path):
    cfg = settings(tmp_path)
    side = SchedulerSide(*engine_config(tp=2), cfg)
    tokens = list(range(5 * BLOCK + 3))
    request = make_request("r", tokens)
    assert side.match(request, 0) == 0
    keys = side._keys(side._state(request), 5)
    put_blocks(cfg, side.engine.specs[0][0], keys[0][0])  # rank 0's parts only
    # a new request each time: a retry of one reuses its first answer
    assert side.match(make_request("r", tokens), 0) == 0
    put_blocks(cfg, side.engine.specs[1][0], keys[1][0][:3])  # rank 1 has 3
    request = make_request("r", tokens)
    assert side.match(request, 0) == 3 * BLOCK
    assert side.match(request, BLOCK) == 2 * BLOCK  # beyond the local hit
    side.close()


def test_mla_is_stored_once_for_all_ranks(tmp_path):
    side = SchedulerSide(*engine_config(tp=4, mla=True), settings(tmp_path))
    assert len(side.engine.specs) == 1
    assert side.engine.specs[0][0].rank_independent
    side.close()


def test_never_claims_the_last_token_and_salt_changes_keys(tmp_path):
    cfg = settings(tmp_path)
    side = SchedulerSide(*engine_config(), cfg)
    tokens = list(range(4 * BLOCK))  # exactly 4 full blocks
    request = make_request("a", tokens)
    ((keys,),) = side._keys(side._state(request), 4)
    put_blocks(cfg, side.engine.specs[0][0], keys)
    assert side.match(request, 0) == 3 * BLOCK  # the last token is computed
    salted = make_request("b", tokens, salt="tenant-2")
    assert side.match(salted, 0) == 0
    side.close()


def test_plans_prompt_saves_once_and_holds_finished_requests(tmp_path):
    side = SchedulerSide(*engine_config(), settings(tmp_path))
    side.block_ids = ManagerBlockIds(
        SimpleNamespace(get_block_ids=lambda rid: ([7, 3, 9, 4],))
    )
    request = make_request("r", list(range(3 * BLOCK + 5)))
    assert side.match(request, 0) == 0
    side.allocated(request, ([7, 3, 9, 4],), 0)
    chunked = SimpleNamespace(num_scheduled_tokens={"r": 2 * BLOCK})
    meta = side.build_meta(chunked)  # chunked prefill: 2 blocks full this step
    assert [s.block_ids for s in meta.saves] == [[7, 3]]
    request.num_computed_tokens = 2 * BLOCK
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": BLOCK + 5}))
    assert [s.block_ids for s in meta.saves] == [[9]]
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 1}))
    assert meta.saves == []  # decode: nothing new (save_decode is off)
    assert side.finished(request) is True
    assert side.build_meta(SimpleNamespace(num_scheduled_tokens={})).held_req_ids == [
        "r"
    ]
    side.close()


@pytest.mark.parametrize(
    ("device", "layerwise", "hinted"),
    [
        ("cpu", "auto", False),  # auto stays bulk on the CPU: one streamed read
        ("cpu", "off", False),
        ("cpu", "on", True),
        ("npu", "auto", True),  # a device loads layer by layer
        ("cuda", "off", False),
    ],
)
def test_readahead_hint_only_where_workers_load_layerwise(
    tmp_path, device, layerwise, hinted
):
    cfg = settings(tmp_path, layerwise=layerwise)
    vllm_config, kv_cache_config = engine_config()
    vllm_config.device_config = SimpleNamespace(device_type=device)
    side = SchedulerSide(vllm_config, kv_cache_config, cfg)
    request = make_request("r", list(range(4 * BLOCK + 1)))
    ((keys,),) = side._keys(side._state(request), 4)
    put_blocks(cfg, side.engine.specs[0][0], keys)
    hints: list[list[bytes]] = []
    side.store.readahead = lambda chain: hints.append(list(chain)) or 1
    assert side.match(request, 0) == 4 * BLOCK
    side.allocated(request, ([5, 6, 7, 8, 9],), 4 * BLOCK)
    assert hints == ([keys] if hinted else [])
    side.close()


# -- worker side ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("save_mode", "load_mode", "dst_ids"),
    [
        ("on", "off", [1, 2, 5, 6, 31]),  # scattered: through a host slot
        ("off", "on", [1, 2, 5, 6, 31]),
        ("off", "on", [10, 11, 12, 13, 14]),  # one run: read into the pages
        ("on", "off", [10, 11, 12, 13, 14]),
        ("off", "off", [14, 13, 12, 11, 10]),  # descending: in place as well
        ("on", "on", [24, 23, 22, 21, 20]),
        ("off", "off", [7, 8]),  # a short single run: in place too
        ("off", "on", [9]),
    ],
)
def test_worker_saves_and_loads_blocks_bit_exact(
    tmp_path, save_mode, load_mode, dst_ids
):
    source = cpu_caches(seed=1)
    keys = [bytes([i]) * 16 for i in range(5)][: len(dst_ids)]
    src_ids = [3, 17, 4, 30, 9][: len(dst_ids)]
    saver = worker_for(tmp_path, source, layerwise=save_mode)
    saver.bind(NPUKVMetadata(saves=[transfer(keys, src_ids)]))
    for name in LAYERS:  # the layer hooks (a no-op in bulk mode)
        saver.wait_layer(name)
        saver.save_layer(name)
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()

    target = cpu_caches(seed=2)
    before = {name: t.clone() for name, t in target.items()}
    loader = worker_for(tmp_path, target, layerwise=load_mode, prefetch_depth=1)
    assert loader.loader is not None
    direct = loader.loader._direct_runs(loader.layers[0].layout, dst_ids)
    assert (direct is not None) == (dst_ids[0] != 1)
    if dst_ids[0] == 24:  # runs up and down, and a lone block between them
        mixed = [20, 21, 22, 23, 40, 9, 8, 7, 6, 5, 30, 31, 32, 33, 34, 35]
        assert loader.loader._direct_runs(loader.layers[0].layout, mixed) == [
            (0, 4, 1), (4, 1, 1), (5, 5, -1), (10, 6, 1),
        ]  # fmt: skip
    loader.bind(NPUKVMetadata(loads=[transfer(keys, dst_ids)]))
    loader.start_load()
    for name in LAYERS:
        loader.wait_layer(name)
        loader.save_layer(name)
    loader.finish_step()
    assert loader.take_load_errors() == set()
    for name in LAYERS:
        torch.testing.assert_close(target[name][dst_ids], source[name][src_ids])
        others = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
        torch.testing.assert_close(target[name][others], before[name][others])
    loader.close()


def test_in_place_loads_slice_views_made_at_register(tmp_path):
    """The pages a direct load reads into are slices of per-layer views made
    when the loader is built: a hit's start_load_kv makes no host view (each
    cost a ctypes type, the first one numpy.ctypeslib's lazy import)."""
    source = cpu_caches(seed=5)
    keys = [bytes([60 + i]) * 16 for i in range(3)]
    saver = worker_for(tmp_path, source, layerwise="off")
    saver.bind(NPUKVMetadata(saves=[transfer(keys, [2, 3, 4])]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()
    target = cpu_caches(seed=6)
    loader = worker_for(tmp_path, target, layerwise="off")
    assert loader.loader is not None

    def no_view(ptr: int, nbytes: int) -> None:
        raise AssertionError("a host view made on the load path")

    loader.loader._host_view = no_view  # type: ignore[assignment]
    loader.bind(NPUKVMetadata(loads=[transfer(keys, [20, 21, 22])]))
    loader.start_load()
    loader.finish_step()
    assert loader.take_load_errors() == set()
    for name in LAYERS:
        torch.testing.assert_close(target[name][[20, 21, 22]], source[name][[2, 3, 4]])
    loader.close()


def test_skipped_load_hook_reports_errors_and_falls_back(tmp_path, caplog):
    source = cpu_caches(seed=3)
    keys = [bytes([40 + i]) * 16 for i in range(2)]
    saver = worker_for(tmp_path, source, layerwise="off")
    saver.bind(NPUKVMetadata(saves=[transfer(keys, [5, 6])]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()
    loader = worker_for(tmp_path, cpu_caches(seed=4), layerwise="on")
    loader.bind(NPUKVMetadata(loads=[transfer(keys, [8, 9])]))
    loader.start_load()
    loader.wait_layer(LAYERS[0])  # layers 1 and 2 never call the hook
    with caplog.at_level(logging.WARNING, logger="npukv_store"):
        loader.finish_step()
    assert loader.take_load_errors() == {8, 9}
    assert loader.layerwise is False
    assert "load hook was skipped" in caplog.text
    loader.close()


def test_missing_blocks_are_load_errors_and_disabled_worker_loads_nothing(tmp_path):
    worker = worker_for(tmp_path, cpu_caches(seed=5), layerwise="off")
    worker.bind(NPUKVMetadata(loads=[transfer([b"\x01" * 16, b"\x02" * 16], [3, 4])]))
    worker.start_load()
    worker.finish_step()
    assert worker.take_load_errors() == {3, 4}
    worker.close()
    off = WorkerSide(*engine_config(), settings(tmp_path))
    sliced = {n: t[..., :HEAD_DIM] for n, t in cpu_caches(seed=6).items()}
    off.register(sliced)  # K halves only: not byte runs of a whole block
    assert "layer" in off.disabled_reason
    off.bind(NPUKVMetadata(loads=[transfer([b"\x03" * 16], [7])], held_req_ids=["x"]))
    off.start_load()
    off.finish_step()
    assert off.take_load_errors() == {7}
    assert off.finished_sending() == {"x"}  # held blocks are still released


@pytest.mark.parametrize("kind", ["npu", "cpu"])
def test_auto_switches_to_layerwise_after_seeing_every_hook(tmp_path, kind):
    """On an accelerator auto turns layerwise on once every hook was seen; on
    the CPU (copies share the compute cores) it stays bulk."""
    worker = worker_for(tmp_path, cpu_caches(seed=7), layerwise="auto")
    worker.backend.kind = kind  # the switch only looks at the kind
    assert worker.layerwise is False
    worker.bind(NPUKVMetadata())
    for name in LAYERS[:2]:
        worker.wait_layer(name)
        worker.save_layer(name)
    worker.finish_step()
    assert worker.layerwise is False  # one layer never called its hooks
    worker.bind(NPUKVMetadata())
    for name in LAYERS:
        worker.wait_layer(name)
        worker.save_layer(name)
    worker.finish_step()
    assert worker.layerwise is (kind == "npu")
    assert worker._observe_hooks is False
    worker.close()


def test_bad_config_turns_the_connector_off_with_one_clear_error(tmp_path, caplog):
    """A bad key or value never raises into vLLM's start-up: both roles are
    off, with one error line naming the key, what was found and expected."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vllm_config, kv_cache_config = engine_config(
        extra={"cache_dir": str(tmp_path), "capacity": "lots", "layerwise": "on"}
    )
    for role, extra, fragment in (
        (KVConnectorRole.SCHEDULER, None, "capacity: found 'lots'"),
        (KVConnectorRole.WORKER, {"cache_dir": str(tmp_path), "prefetch": 2},
         "unknown config key"),
    ):  # fmt: skip
        if extra is not None:
            vllm_config.kv_transfer_config.kv_connector_extra_config = extra
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="npukv_store"):
            connector = NPUKVStoreConnector(vllm_config, role, kv_cache_config)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, caplog.text
        assert "the connector is off" in errors[0].getMessage()
        assert fragment in errors[0].getMessage()
        assert "expected" in errors[0].getMessage()
        assert connector._scheduler is None
        assert connector._worker is None
        connector.shutdown()


def test_scheduler_turns_load_failures_into_recompute(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vllm_config, kv_cache_config = engine_config(extra={"cache_dir": str(tmp_path)})
    connector = NPUKVStoreConnector(
        vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    assert vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert NPUKVStoreConnector.requires_piecewise_for_cudagraph({"layerwise": "on"})
    assert not NPUKVStoreConnector.requires_piecewise_for_cudagraph(
        {"layerwise": "off"}
    )
    connector.shutdown()


def test_namespace_names_a_local_model_by_its_real_path(tmp_path):
    from npukv_store.connector.namespace import engine_namespaces

    real = tmp_path / "ckpt"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    specs = []
    for name in (str(real), str(tmp_path / "link"), str(tmp_path / "." / "ckpt")):
        vllm_config, kv_cache_config = engine_config()
        vllm_config.model_config.model = name
        engine = engine_namespaces(vllm_config, kv_cache_config, settings(tmp_path))
        specs += engine.specs[0]
    assert len({spec.canonical_json() for spec in specs}) == 1
    vllm_config, kv_cache_config = engine_config()  # a hub name stays as given
    ((spec,),) = engine_namespaces(
        vllm_config, kv_cache_config, settings(tmp_path)
    ).specs
    assert spec.model == "tiny-llama"


def test_corrupt_row_read_into_the_pages_is_a_load_error(tmp_path):
    source = cpu_caches(seed=8)
    keys = [bytes([60 + i]) * 16 for i in range(4)]
    saver = worker_for(tmp_path, source, layerwise="off")
    saver.bind(NPUKVMetadata(saves=[transfer(keys, [0 + 3, 4, 5, 6])]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()
    (chunk,) = (tmp_path / "cache").glob("*/chunks/*.safetensors")
    data = bytearray(chunk.read_bytes())
    data[-8 * 3 * 4 - 1] ^= 0xFF  # last byte of the data section: last row, layer 2
    chunk.write_bytes(bytes(data))
    target = cpu_caches(seed=9)
    loader = worker_for(tmp_path, target, layerwise="off")
    loader.bind(NPUKVMetadata(loads=[transfer(keys, [20, 21, 22, 23])]))
    loader.start_load()
    loader.finish_step()
    assert loader.take_load_errors() == {23}
    for name in LAYERS:
        torch.testing.assert_close(target[name][20:23], source[name][3:6])
    loader.close()


def test_save_decode_plans_generated_blocks_as_they_fill(tmp_path):
    side = SchedulerSide(*engine_config(), settings(tmp_path, save_decode=True))
    side.block_ids = ManagerBlockIds(
        SimpleNamespace(get_block_ids=lambda rid: ([5, 6, 7],))
    )
    request = make_request("r", list(range(2 * BLOCK - 1)))
    side.match(request, 0)
    side.allocated(request, ([5, 6],), 0)
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 2 * BLOCK - 1}))
    assert [s.block_ids for s in meta.saves] == [[5]]  # block 1 lacks a token
    request.num_computed_tokens = 2 * BLOCK - 1
    request.all_token_ids.append(7)  # the first sampled token completes block 1
    request.num_tokens += 1
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 1}))
    assert [s.block_ids for s in meta.saves] == [[6]]
    ((keys,),) = side._keys(side._state(request), 2)
    assert meta.saves[0].keys(0) == keys[1:]
    request.num_computed_tokens += 1
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 1}))
    assert meta.saves == []  # the token of this step is not sampled yet
    assert side.finished(request) is True
    side.close()
