"""The seam between the connector and vLLM's versions (connector/vllm_api.py):
the supported range, the block ids of vLLM < 0.32 tracked from the scheduler's
output, the constructors that never raise, the refusals that keep KV right
(context parallelism, hybrid loads where vLLM cannot take failures back) and
the LoRA identity that lasts across restarts.

These run on whichever vLLM the lane installed (0.32 in the main lane, 0.23,
0.30, 0.33 and 0.34 in the others): the version-specific paths are forced
where another vLLM would take them.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
)

from npukv_store.connector import connector as connector_module
from npukv_store.connector import vllm_api
from npukv_store.connector.connector import NPUKVStoreConnector
from npukv_store.connector.namespace import engine_namespaces
from npukv_store.connector.scheduler import side as scheduler_module
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.errors import UnsupportedSetup
from tests.support.connector import (
    BLOCK,
    engine_config,
    hybrid_config,
    make_request,
    put_blocks,
)
from tests.support.connector import settings as store_settings

# -- the supported range ------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "verdict"),
    [
        ("0.23.0", ""),
        ("0.23.0.post1", ""),
        ("0.30.0", ""),  # vllm-ascend 0.30.0rc2's vLLM
        ("0.30.0+cpu", ""),
        ("0.32.0+cpu", ""),
        ("0.33.1", ""),
        ("0.34.0", ""),
        ("0.34.2", ""),
        ("0.22.1", "outside the tested range 0.23 to 0.34"),
        ("0.35.0", "outside the tested range 0.23 to 0.34"),
        ("0.35.0rc1", "outside the tested range 0.23 to 0.34"),
        ("1.0.0", "outside the tested range 0.23 to 0.34"),
        ("dev", ""),  # a source build without a release: its features decide
    ],
)
def test_the_supported_range_is_0_23_to_0_34(version, verdict):
    reason = vllm_api.unsupported(version)
    assert verdict in reason
    assert bool(reason) == bool(verdict)
    if reason:
        assert f"vLLM {version}" in reason
        assert "\n" not in reason  # one line


def test_this_vllm_is_supported_and_its_features_are_the_ones_it_has():
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    assert vllm_api.unsupported() == ""
    has_results = hasattr(base, "KVConnectorTransferResults")
    assert has_results == vllm_api.REPORTS_FAILED_LOADS
    results = vllm_api.TransferResults(finished_sending={"a"})
    assert results.finished_sending == {"a"}
    assert results.failed_recving == set()


def _connector(role, tmp_path, caplog, **kw):
    vllm_config, kv_cache_config = engine_config(
        extra={"cache_dir": str(tmp_path / "cache"), "ring_size": "8MiB"}, **kw
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="npukv_store"):
        connector = NPUKVStoreConnector(vllm_config, role, kv_cache_config)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return connector, errors


def _answers_harmlessly(connector, role) -> None:
    """An off connector answers every vLLM call without raising."""
    if role == KVConnectorRole.SCHEDULER:
        request = make_request("r", list(range(3 * BLOCK + 1)))
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        connector.update_state_after_alloc(request, SimpleNamespace(), 0)
        meta = connector.build_connector_meta(SimpleNamespace())
        assert meta.is_empty()
        assert connector.request_finished(request, []) == (False, None)
    else:
        connector.register_kv_caches({})
        connector.start_load_kv(None)
        connector.wait_for_layer_load("model.layers.0.self_attn.attn")
        connector.save_kv_layer("model.layers.0.self_attn.attn", None, None)
        connector.wait_for_save()
        assert connector.get_finished(set()) == (None, None)
        assert connector.get_block_ids_with_load_errors() == set()
    connector.shutdown()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_an_unsupported_vllm_turns_the_connector_off_with_one_line(
    role, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(vllm_api, "VLLM_VERSION", "0.35.0")
    monkeypatch.setattr(connector_module, "_reported_off", set())
    reason = vllm_api.unsupported("0.35.0")
    monkeypatch.setattr(vllm_api, "unsupported", lambda: reason)
    connector, errors = _connector(role, tmp_path, caplog)
    assert len(errors) == 1, errors
    assert "the connector is off" in errors[0]
    assert "vLLM 0.35.0 is outside the tested range 0.23 to 0.34" in errors[0]
    assert not (tmp_path / "cache").exists(), "an unsupported vLLM touched the disk"
    _answers_harmlessly(connector, role)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_an_exception_in_either_constructor_never_reaches_vllm(
    role, tmp_path, caplog, monkeypatch
):
    """Injected: any fault while a side starts means the connector is off in
    that process, with one error line, and vLLM's calls are answered."""

    def broken(*args, **kwargs):
        raise KeyError("injected start-up fault")

    monkeypatch.setattr(connector_module, "_reported_off", set())
    side = "SchedulerSide" if role == KVConnectorRole.SCHEDULER else "WorkerSide"
    monkeypatch.setattr(connector_module, side, broken)
    connector, errors = _connector(role, tmp_path, caplog)
    assert len(errors) == 1, errors
    assert "the connector is off" in errors[0]
    assert "injected start-up fault" in errors[0]
    assert "Traceback" not in caplog.text
    _answers_harmlessly(connector, role)


def test_a_fault_deep_in_the_scheduler_side_start_is_caught(
    tmp_path, caplog, monkeypatch
):
    """Not only the constructor's own lines: a fault in what it calls (here
    the namespace of the engine) turns the connector off too."""

    def broken(*args, **kwargs):
        raise AttributeError("'KVCacheConfig' object has no attribute 'x'")

    monkeypatch.setattr(connector_module, "_reported_off", set())
    monkeypatch.setattr(scheduler_module, "engine_namespaces", broken)
    connector, errors = _connector(KVConnectorRole.SCHEDULER, tmp_path, caplog)
    assert len(errors) == 1, errors
    assert "has no attribute 'x'" in errors[0]
    _answers_harmlessly(connector, KVConnectorRole.SCHEDULER)


# -- refusals that keep KV right ------------------------------------------------------


@pytest.mark.parametrize(("dcp", "pcp"), [(2, 1), (1, 2), (4, 2)])
def test_context_parallel_is_refused_with_one_line(tmp_path, dcp, pcp):
    for mla in (False, True):
        vllm_config, kv_cache_config = engine_config(mla=mla, tp=4)
        vllm_config.parallel_config.decode_context_parallel_size = dcp
        vllm_config.parallel_config.prefill_context_parallel_size = pcp
        with pytest.raises(UnsupportedSetup, match="context parallelism") as caught:
            engine_namespaces(vllm_config, kv_cache_config, store_settings(tmp_path))
        assert f"decode_context_parallel_size={dcp}" in str(caught.value)
        assert f"prefill_context_parallel_size={pcp}" in str(caught.value)
    vllm_config, kv_cache_config = engine_config()
    vllm_config.parallel_config.decode_context_parallel_size = 1
    engine_namespaces(vllm_config, kv_cache_config, store_settings(tmp_path))


def test_a_kv_cache_config_without_a_layout_is_keyed_without_one(tmp_path):
    """vLLM < 0.32's KVCacheConfig has no kv_cache_layout."""
    vllm_config, kv_cache_config = engine_config()
    with_layout = engine_namespaces(
        vllm_config, kv_cache_config, store_settings(tmp_path)
    )
    del kv_cache_config.kv_cache_layout
    without = engine_namespaces(vllm_config, kv_cache_config, store_settings(tmp_path))
    assert "layout=LBHNC;" in with_layout.specs[0][0].extra
    assert "layout=;" in without.specs[0][0].extra


def test_hybrid_models_only_save_where_vllm_cannot_take_failed_loads_back(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(scheduler_module, "REPORTS_FAILED_LOADS", False)
    with caplog.at_level(logging.WARNING, logger="npukv_store"):
        side = SchedulerSide(*hybrid_config(), store_settings(tmp_path))
    assert not side.loads_on
    lines = [
        r.getMessage() for r in caplog.records if "loads are off" in r.getMessage()
    ]
    assert len(lines) == 1, caplog.text
    assert "2 KV cache groups" in lines[0]
    assert "failed_recving" in lines[0]
    request = make_request("r", list(range(6 * BLOCK + 5)))
    assert side.match(request, 0) == 0
    side.block_ids = vllm_api.ManagerBlockIds(
        SimpleNamespace(
            get_block_ids=lambda rid: (list(range(1, 8)), list(range(11, 18)))
        )
    )
    side.allocated(request, ([], []), 0)
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={"r": 6 * BLOCK + 5}))
    assert {s.group for s in meta.saves} == {0, 1}  # saves go on
    assert meta.loads == []
    side.close()
    monkeypatch.setattr(scheduler_module, "REPORTS_FAILED_LOADS", True)
    side = SchedulerSide(*hybrid_config(), store_settings(tmp_path))
    assert side.loads_on
    side.close()


# -- LoRA ---------------------------------------------------------------------------


def _lora(name: str, path: str):
    return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=1)


def test_an_adapter_re_pointed_under_the_same_name_misses(tmp_path):
    cfg = store_settings(tmp_path)
    side = SchedulerSide(*engine_config(), cfg)
    tokens = list(range(4 * BLOCK + 1))
    first = make_request("a", tokens)
    first.lora_request = _lora("sql", "/adapters/sql-v1")
    ((keys,),) = side._keys(side._state(first), 4)
    put_blocks(cfg, side.engine.specs[0][0], keys)
    assert side.match(first, 0) == 4 * BLOCK
    again = make_request("b", tokens)
    again.lora_request = _lora("sql", "/adapters/sql-v1")
    assert side.match(again, 0) == 4 * BLOCK  # the same adapter hits
    moved = make_request("c", tokens)
    moved.lora_request = _lora("sql", "/adapters/sql-v2")
    assert side.match(moved, 0) == 0
    renamed = make_request("d", tokens)
    renamed.lora_request = _lora("sql2", "/adapters/sql-v1")
    assert side.match(renamed, 0) == 0
    base = make_request("e", tokens)
    assert side.match(base, 0) == 0
    side.close()


# -- block ids on vLLM < 0.32 ---------------------------------------------------------


def test_block_ids_come_from_vllms_manager_where_it_binds_one():
    manager = SimpleNamespace(get_block_ids=lambda rid: ([4, 5],))
    source = vllm_api.block_ids_source(SimpleNamespace(_kv_cache_manager=manager))
    assert isinstance(source, vllm_api.ManagerBlockIds)
    assert source.get_block_ids("r") == ([4, 5],)
    assert isinstance(
        vllm_api.block_ids_source(SimpleNamespace()), vllm_api.BlockIdTracker
    )
    unbound = SimpleNamespace(_kv_cache_manager=None)
    assert isinstance(vllm_api.block_ids_source(unbound), vllm_api.BlockIdTracker)


def _output(new=(), cached=(), resumed=(), finished=(), preempted=()):
    """A SchedulerOutput of vLLM 0.23 with the fields the tracker reads."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, block_ids=ids) for rid, ids in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid for rid, _ in cached],
            new_block_ids=[ids for _, ids in cached],
            resumed_req_ids=set(resumed),
        ),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


_GROUPS = 2
_ids = st.lists(st.integers(1, 999), max_size=3)
_step = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "none", "resume", "finish", "preempt"]),
        st.sampled_from(["a", "b", "c"]),
        st.tuples(*[_ids] * _GROUPS),
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_step, max_size=12))
def test_tracked_block_ids_follow_the_model_runners_rules(steps):
    """Property: the tracker holds what vLLM's model runner would, whatever
    the sequence of new, running, resumed, preempted and finished requests."""
    tracker = vllm_api.BlockIdTracker()
    model: dict[str, list[list[int]]] = {}
    for step in steps:
        new, cached, resumed, finished, preempted = [], [], set(), set(), set()
        seen = set()
        for op, rid, ids in step:
            if rid in seen:
                continue  # a request appears once per step
            seen.add(rid)
            if op == "new":
                new.append((rid, ids))
            elif op == "finish":
                finished.add(rid)
            elif op == "preempt":
                preempted.add(rid)
            elif rid in model or op == "resume":
                cached.append((rid, None if op == "none" else ids))
                if op == "resume":
                    resumed.add(rid)
        tracker.update(_output(new, cached, resumed, finished, preempted))
        for rid in finished | preempted:
            model.pop(rid, None)
        for rid, ids in new:
            model[rid] = [list(g) for g in ids]
        for rid, ids in cached:
            if ids is None:
                continue
            if rid in resumed or rid not in model:
                model[rid] = [list(g) for g in ids]
            else:
                for group, more in zip(model[rid], ids, strict=True):
                    group.extend(more)
        for rid, ids in model.items():
            assert tracker.get_block_ids(rid) == tuple(ids)
        for rid in {"a", "b", "c"} - set(model):
            with pytest.raises(KeyError):
                tracker.get_block_ids(rid)


def test_saves_are_planned_from_tracked_block_ids(tmp_path):
    """vLLM 0.23: no manager bound; the blocks of each step's saves are the
    ones the scheduler output gave the request, step after step."""
    side = SchedulerSide(*engine_config(), store_settings(tmp_path))
    side.block_ids = vllm_api.BlockIdTracker()
    request = make_request("r", list(range(3 * BLOCK + 5)))
    side.match(request, 0)
    side.allocated(request, ([7, 3],), 0)
    first = _output(new=[("r", ([7, 3],))])
    first.num_scheduled_tokens = {"r": 2 * BLOCK}
    assert [s.block_ids for s in side.build_meta(first).saves] == [[7, 3]]
    request.num_computed_tokens = 2 * BLOCK
    second = _output(cached=[("r", ([9, 4],))])
    second.num_scheduled_tokens = {"r": BLOCK + 5}
    assert [s.block_ids for s in side.build_meta(second).saves] == [[9]]
    assert side.finished(request) is True
    with pytest.raises(KeyError):
        side.block_ids.get_block_ids("r")
    side.close()
