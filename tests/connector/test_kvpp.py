"""vllm-ascend's KVPP (0.30+): each TP rank keeps only its own layers' KV and
registers the others as views of two shared scratch buffers. The connector
refuses it by name at start-up (namespace._refuse_kvpp), and a worker refuses
any registration in which two layers of one KV cache group share bytes
(worker/layer_overlap.py), so a scratch view is never saved as a layer's KV.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from npukv_store.connector import connector as connector_module
from npukv_store.connector.connector import NPUKVStoreConnector
from npukv_store.connector.namespace import engine_namespaces
from npukv_store.connector.worker.layer_overlap import refuse_shared_layers
from npukv_store.connector.worker.pages import LayerLayout, LayoutError, Segment
from npukv_store.connector.worker.side import WorkerSide
from npukv_store.errors import UnsupportedSetup
from tests.support.connector import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    NUM_BLOCKS,
    attention_spec,
    engine_config,
)
from tests.support.connector import settings as store_settings

SIX = [f"model.layers.{i}.self_attn.attn" for i in range(6)]


def _kvpp_config(tp: int, enabled: object, mla: bool = True):
    vllm_config, kv_cache_config = engine_config(tp=tp, mla=mla)
    vllm_config.additional_config = {"enable_kvpp": enabled}
    return vllm_config, kv_cache_config


# -- refused by name ----------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, "true", "on"])
@pytest.mark.parametrize("mla", [True, False])
def test_kvpp_over_several_ranks_is_refused_by_name(tmp_path, enabled, mla):
    vllm_config, kv_cache_config = _kvpp_config(4, enabled, mla)
    with pytest.raises(UnsupportedSetup, match="KVPP") as caught:
        engine_namespaces(vllm_config, kv_cache_config, store_settings(tmp_path))
    assert "enable_kvpp" in str(caught.value)
    assert "over 4 ranks" in str(caught.value)


@pytest.mark.parametrize(("tp", "enabled"), [(1, True), (4, False), (4, "false")])
def test_kvpp_off_or_on_one_rank_is_served(tmp_path, tp, enabled):
    """With one rank in the group (TP 1), KVPP allocates every layer on it
    (kvpp_config.size == 1): nothing to refuse."""
    vllm_config, kv_cache_config = _kvpp_config(tp, enabled)
    engine = engine_namespaces(vllm_config, kv_cache_config, store_settings(tmp_path))
    assert engine.specs


def test_kvpp_turns_the_connector_off_with_one_error_line(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(connector_module, "_reported_off", set())
    vllm_config, kv_cache_config = engine_config(
        tp=2, mla=True, extra={"cache_dir": str(tmp_path / "c"), "ring_size": "8MiB"}
    )
    vllm_config.additional_config = {"enable_kvpp": True}
    errors, connectors = [], []
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="npukv_store"):
            connectors.append(NPUKVStoreConnector(vllm_config, role, kv_cache_config))
        errors += [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    # the scheduler says it; the worker, off for the same reason, stays quiet
    assert len(errors) == 1, errors
    assert "KVPP" in errors[0]
    assert "connector is off" in errors[0]
    scheduler, worker = connectors
    assert scheduler.get_num_new_matched_tokens(SimpleNamespace(), 0) == (0, False)
    assert "KVPP" in worker._worker.disabled_reason
    worker.register_kv_caches({})  # and answers harmlessly


# -- a registration with shared scratch views is refused ------------------------------


def _kvpp_caches(rank: int, ranks: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s registration as allocate_kvpp_cache builds it
    (vllm_ascend/worker/kvpp_cache.py, 0.30.0rc2): a buffer of its own for each
    layer it owns (round robin here), and for every other layer a view of one
    of two scratch buffers, taken in turn."""
    numel = NUM_BLOCKS * HEADS * BLOCK * 2 * HEAD_DIM
    scratch = [torch.zeros(numel), torch.zeros(numel)]
    caches, foreign = {}, 0
    for index, name in enumerate(SIX):
        if index % ranks == rank:
            buffer = torch.randn(numel)
        else:
            buffer = scratch[foreign % len(scratch)]
            foreign += 1
        caches[name] = buffer.view(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    return caches


def _six_layer_config(tp: int):
    """Six layers of one group; MLA-keyed (one namespace for every rank, as
    KVPP's MLA/SFA models are), so a worker needs no vLLM process group."""
    group = SimpleNamespace(layer_names=SIX, kv_cache_spec=attention_spec())
    return engine_config(tp=tp, mla=True, groups=[group])


def test_a_worker_refuses_layers_registered_as_views_of_one_scratch_buffer(tmp_path):
    worker = WorkerSide(*_six_layer_config(tp=2), store_settings(tmp_path))
    worker.register(_kvpp_caches(rank=0, ranks=2))
    # rank 0 owns 0, 2, 4; 1 and 5 share scratch[0], 3 is alone in scratch[1]
    assert "share bytes" in worker.disabled_reason
    assert repr(SIX[1]) in worker.disabled_reason
    assert repr(SIX[5]) in worker.disabled_reason
    assert "group 0" in worker.disabled_reason


def test_a_worker_accepts_layers_of_one_buffer_in_their_own_regions(tmp_path):
    """vLLM's own allocation: one backing buffer, a region per layer."""
    numel = NUM_BLOCKS * HEADS * BLOCK * 2 * HEAD_DIM
    shared = torch.randn(len(SIX) * numel)
    caches = {
        name: shared[i * numel : (i + 1) * numel].view(
            NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM
        )
        for i, name in enumerate(SIX)
    }
    worker = WorkerSide(*_six_layer_config(tp=1), store_settings(tmp_path))
    worker.register(caches)
    assert worker.disabled_reason == ""
    worker.close()


# -- the check itself, on random layouts ----------------------------------------------


def _layouts(
    layers: int, blocks: int, run: int, pad: int, block_major: bool
) -> list[LayerLayout]:
    """Layer-major (each layer its region) or block-major (BLHNC: each block
    holds every layer's page in turn) layouts of one buffer at 4096."""
    page = run + pad
    out = []
    for layer in range(layers):
        if block_major:
            base, stride = 4096 + layer * page, layers * page
        else:
            base, stride = 4096 + layer * blocks * page, page
        segment = Segment(base, stride, run, blocks)
        out.append(LayerLayout(f"l{layer}", (segment,), run))
    return out


@settings(max_examples=200, deadline=None)
@given(
    layers=st.integers(2, 12),
    blocks=st.integers(1, 40),
    run=st.integers(1, 512),
    pad=st.integers(0, 256),
    block_major=st.booleans(),
    data=st.data(),
)
def test_disjoint_layers_pass_and_any_aliased_pair_is_named(
    layers, blocks, run, pad, block_major, data
):
    layouts = _layouts(layers, blocks, run, pad, block_major)
    refuse_shared_layers((0, layout) for layout in layouts)  # disjoint: accepted
    # the same layouts in another group each: never compared across groups
    refuse_shared_layers(enumerate(layouts + layouts))
    a, b = sorted(data.draw(st.lists(st.integers(0, layers - 1), min_size=2,
                                     max_size=2, unique=True)))  # fmt: skip
    shift = data.draw(st.integers(-(run - 1), run - 1))
    alias = layouts[a].segments[0]
    moved = Segment(alias.base_ptr + shift, alias.block_stride, run, blocks)
    layouts[b] = LayerLayout(f"l{b}", (moved,), run)
    with pytest.raises(LayoutError, match="share bytes") as caught:
        refuse_shared_layers((0, layout) for layout in layouts)
    # the moved layer, and one it meets (a, or a neighbour of a it reaches)
    assert f"'l{b}'" in str(caught.value), str(caught.value)
