"""Mamba / linear-attention (state) groups: a hit needs the state at its end,
states are saved only from the blocks vLLM hands over, and a worker copies a
state page (vLLM's padded list of conv and SSM views) bit for bit.

The real-vLLM run is tests/e2e/test_families.py (tiny Qwen3-Next). Here both
halves run without an engine, with vLLM's own MambaSpec; vLLM 0.23 has no
hand-off and refuses the group (the last test).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import MambaSpec

from npukv_store.connector import namespace
from npukv_store.connector.groups import KVGroup, blocks_to_save, hit_end
from npukv_store.connector.metadata import BlockTransfer, NPUKVMetadata
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.vllm_api import (
    HANDS_OFF_BOUNDARY_STATES,
    VLLM_VERSION,
    ManagerBlockIds,
)
from npukv_store.connector.worker.side import WorkerSide
from tests.support.connector import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    NUM_BLOCKS,
    attention_spec,
    engine_config,
    make_request,
    received,
    settings,
)

STATE_LAYERS = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
ATTN_LAYERS = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
CONV, SSM = (3, 64), (2, 16, 16)  # fp32: 768 + 2048 bytes
STATE_BYTES = 4 * (3 * 64 + 2 * 16 * 16)
PADDED = STATE_BYTES + 512  # vLLM pads a state page to the attention page

needs_handoff = pytest.mark.skipif(
    not HANDS_OFF_BOUNDARY_STATES,
    reason=f"vLLM {VLLM_VERSION} hands no Mamba state blocks to a connector: "
    "the group is refused there (test_a_vllm_without_hand_offs_refuses_...)",
)


@pytest.fixture(autouse=True)
def _vllm_takes_failed_loads_back(monkeypatch):
    from npukv_store.connector.scheduler import side as scheduler

    monkeypatch.setattr(scheduler, "REPORTS_FAILED_LOADS", True)


def mamba_spec(**fields) -> MambaSpec:
    base = dict(
        block_size=BLOCK, shapes=(CONV, SSM), dtypes=(torch.float32, torch.float32),
        page_size_padded=PADDED, mamba_cache_mode="align",
    )  # fmt: skip
    known = MambaSpec.__dataclass_fields__  # vLLM 0.23's spec has fewer
    return MambaSpec(**{k: v for k, v in {**base, **fields}.items() if k in known})


def state_config(**fields):
    """Qwen3-Next-like: a state group and a full-attention group."""
    groups = [
        SimpleNamespace(layer_names=STATE_LAYERS, kv_cache_spec=mamba_spec(**fields)),
        SimpleNamespace(layer_names=ATTN_LAYERS, kv_cache_spec=attention_spec()),
    ]
    return engine_config(groups=groups)


def state_caches(seed: int) -> dict[str, object]:
    """vLLM's layout: per state layer a raw buffer of padded pages and the
    list [conv, ssm] of strided views into it; attention as the CPU's."""
    gen = torch.Generator().manual_seed(seed)
    caches: dict[str, object] = {}
    padded = PADDED // 4
    for name in STATE_LAYERS:
        raw = torch.randn(NUM_BLOCKS * padded, generator=gen)
        conv = raw.as_strided((NUM_BLOCKS, *CONV), (padded, CONV[1], 1))
        ssm = raw.as_strided(
            (NUM_BLOCKS, *SSM), (padded, SSM[1] * SSM[2], SSM[2], 1), 3 * 64
        )
        caches[name] = [conv, ssm]
    for name in ATTN_LAYERS:
        caches[name] = torch.randn(
            NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen
        )
    return caches


def state_bytes(value, block: int) -> bytes:
    return b"".join(
        t[block].contiguous().view(torch.uint8).numpy().tobytes() for t in value
    )


# -- the hit rule -----------------------------------------------------------------


@given(
    local=st.integers(0, 6),
    upper=st.integers(0, 12),
    stored=st.lists(st.booleans(), min_size=12, max_size=12),
)
@hsettings(max_examples=200, deadline=None)
def test_a_hit_ends_where_a_state_is_stored(local, upper, stored):
    """hit_end with a state group: the largest end in (local, upper] whose
    state (block end - 1) is stored, else local; no other block matters."""
    group = KVGroup(0, "state", ("l",), tail_tokens=1)
    rows = stored[local:upper] if upper > local else []
    got = hit_end(local, upper, BLOCK, [(group, rows)])
    ends = [e for e in range(local + 1, upper + 1) if stored[e - 1]]
    assert got == (max(ends) if ends else local)


def test_a_state_group_saves_nothing_by_position():
    group = KVGroup(0, "state", ("l",), tail_tokens=1)
    assert blocks_to_save(group, 0, 8, BLOCK, tails_only=False, ends=[8]) == []
    assert group.tail_start(5, BLOCK) == 4


# -- the scheduler ---------------------------------------------------------------------


@needs_handoff
def test_a_hit_needs_the_state_at_its_end_and_loads_it_alone(tmp_path):
    cfg = settings(tmp_path)
    side = SchedulerSide(*state_config(), cfg)
    assert side.disabled_reason == ""
    assert [g.kind for g in side.engine.groups] == ["state", "full"]
    tokens = list(range(6 * BLOCK + 3))
    request = make_request("r", tokens)
    keys = side._keys(side._state(request), 6)
    state_spec, full_spec = side.engine.specs[0]
    assert [layer.row_bytes for layer in state_spec.layers] == [STATE_BYTES] * 2
    put_blocks_of(cfg, full_spec, keys[0][1][:6])  # KV of 6 blocks
    put_blocks_of(cfg, state_spec, keys[0][0][2:3])  # the state at 3 only
    assert side.match(request, 0) == 3 * BLOCK
    put_blocks_of(cfg, state_spec, keys[0][0][4:5])
    request = make_request("r", tokens)  # a retry would reuse the first answer
    assert side.match(request, 0) == 5 * BLOCK
    assert side.match(request, 3 * BLOCK) == 2 * BLOCK  # beyond a local hit
    request = make_request("r", tokens)
    assert side.match(request, 0) == 5 * BLOCK
    # vLLM: null blocks below the state's block, then the one to load into
    state_ids, full_ids = [0, 0, 0, 0, 31, 32], [11, 12, 13, 14, 15, 16]
    side.allocated(request, (state_ids, full_ids), 5 * BLOCK)
    meta = side.build_meta(SimpleNamespace(num_scheduled_tokens={}))
    loads = {load.group: load for load in meta.loads}
    assert all(load.asynchronous for load in meta.loads)
    assert loads[0].block_ids == [31]
    assert loads[0].keys(0) == keys[0][0][4:5]
    assert loads[1].block_ids == [11, 12, 13, 14, 15]
    side.close()


def put_blocks_of(cfg, spec, keys):
    """put_blocks with each layer's own row size (a state page is not PAGE)."""
    import numpy as np

    from npukv_store import KVStore

    with KVStore(cfg, spec) as store:
        store.put(
            keys,
            {
                f"{layer.name}.page": np.zeros((len(keys), layer.row_bytes), np.uint8)
                for layer in spec.layers
            },
        )


@needs_handoff
def test_states_are_saved_from_the_blocks_vllm_hands_over(tmp_path):
    """A state at boundary t is keyed as block t/bs - 1 of its group's chain;
    mid-block boundaries, other groups, null blocks, boundaries beyond the
    prompt (save_decode off) and repeats in the step are left out; the
    positional table of the state group is never read."""
    side = SchedulerSide(*state_config(), settings(tmp_path))
    request = make_request("r", list(range(6 * BLOCK + 5)))
    side.match(request, 0)
    state_ids, full_ids = [7] * 7, [50, 51, 52, 53, 54, 55, 56]
    side.block_ids = ManagerBlockIds(
        SimpleNamespace(get_block_ids=lambda rid: (state_ids, full_ids))
    )
    side.allocated(request, (state_ids, full_ids), 0)
    handed = {
        "r": [
            (0, 21, 3 * BLOCK), (0, 22, 6 * BLOCK),  # two boundaries
            (0, 23, 6 * BLOCK + 2),  # inside a block (a partial tail)
            (1, 24, 2 * BLOCK),  # not a state group
            (0, 0, 2 * BLOCK),  # a null block
            (0, 25, 7 * BLOCK),  # beyond the prompt
        ],
        "unknown": [(0, 26, BLOCK)],  # no such request
    }  # fmt: skip
    out = SimpleNamespace(
        num_scheduled_tokens={"r": 6 * BLOCK + 5},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=handed),
    )
    meta = side.build_meta(out)
    keys = side._keys(side._state(request), 6)
    saves = [s for s in meta.saves if s.group == 0]
    assert len(saves) == 1
    assert saves[0].block_ids == [21, 22]
    assert saves[0].keys(0) == [keys[0][0][2], keys[0][0][5]]
    full = [s for s in meta.saves if s.group == 1]
    assert full[0].block_ids == full_ids[:6]
    assert side.finished(request)  # held until the copies are reported
    side.close()


# -- the worker --------------------------------------------------------------------


@needs_handoff
def test_a_worker_copies_state_pages_without_their_padding(tmp_path):
    config = state_config()
    source, target = state_caches(1), state_caches(2)
    keys = [bytes([70 + i]) * 16 for i in range(2)]
    saver = WorkerSide(*config, settings(tmp_path, layerwise="off"))
    saver.register(source)
    assert saver.disabled_reason == ""
    saver.bind(NPUKVMetadata(saves=[BlockTransfer("r", [3, 9], [b"".join(keys)])]))
    saver.finish_step()
    assert saver.store is not None
    assert saver.store.flush(timeout_s=30)
    saver.close()
    loader = WorkerSide(*config, settings(tmp_path, layerwise="off"))
    loader.register(target)
    padding_before = [t[0].as_strided((PADDED // 4,), (1,)).clone() for t in
                      (target[n] for n in STATE_LAYERS)]  # fmt: skip
    loader.bind(
        NPUKVMetadata(
            loads=[BlockTransfer("r", [20, 0], [b"".join(keys)], asynchronous=True)]
        )
    )
    loader.start_load()
    loader.finish_step()
    assert received(loader, "r") == set()
    for name in STATE_LAYERS:
        assert state_bytes(target[name], 20) == state_bytes(source[name], 3)
    for name, before in zip(STATE_LAYERS, padding_before, strict=True):
        raw = target[name][0].as_strided((PADDED // 4,), (1,))
        assert torch.equal(raw[STATE_BYTES // 4 :], before[STATE_BYTES // 4 :])
    loader.close()


def test_hooks_are_learned_from_the_attention_layers_alone(tmp_path, monkeypatch):
    """Mamba layers fire no save or load hooks: layerwise auto still turns on
    once every attention layer's hooks fired (on a device)."""
    if not HANDS_OFF_BOUNDARY_STATES:
        pytest.skip(f"vLLM {VLLM_VERSION}: the state group is refused")
    worker = WorkerSide(*state_config(), settings(tmp_path, layerwise="auto"))
    worker.register(state_caches(3))
    assert worker.disabled_reason == ""
    monkeypatch.setattr(worker.backend, "kind", "npu")
    worker.bind(NPUKVMetadata())
    for name in ATTN_LAYERS:
        worker.wait_layer(name)
        worker.save_layer(name)
    worker.finish_step()
    assert worker.layerwise
    worker.close()


# -- refusals ------------------------------------------------------------------------


def test_a_vllm_without_hand_offs_refuses_the_state_group(
    tmp_path, caplog, monkeypatch
):
    """vLLM 0.23 offers no exact state blocks: a state read by position may
    be another prefix's, so the group is refused with one line naming the
    version (and both halves are off)."""
    monkeypatch.setattr(namespace, "HANDS_OFF_BOUNDARY_STATES", False)
    config = state_config()
    side = SchedulerSide(*config, settings(tmp_path))
    assert "KV cache group 0 is MambaSpec" in side.disabled_reason
    assert "hands no Mamba state blocks" in side.disabled_reason
    assert side.match(make_request("r", list(range(5 * BLOCK))), 0) == 0
    worker = WorkerSide(*config, settings(tmp_path))
    worker.register(state_caches(0))
    assert worker.disabled_reason == side.disabled_reason
    assert len([r for r in caplog.records if r.name.startswith("npukv_store")]) == 1
    side.close()
    worker.close()


@pytest.mark.parametrize(
    ("fields", "found"),
    [
        ({"mamba_cache_mode": "none"}, "mamba_cache_mode='none'"),
        ({"mamba_cache_mode": "all"}, "mamba_cache_mode='all'"),
        ({"num_speculative_blocks": 2}, "num_speculative_blocks=2"),
    ],
)
def test_a_state_group_in_another_mode_is_refused(tmp_path, fields, found):
    side = SchedulerSide(*state_config(**fields), settings(tmp_path))
    assert found in side.disabled_reason
    assert "KV cache group 0 is MambaSpec" in side.disabled_reason
    side.close()


@needs_handoff
def test_the_load_policy_prices_one_state_per_hit_not_one_per_block(tmp_path):
    """A hit of n blocks reads n blocks of each full group and one state of
    each state group (a state weighs several KV blocks)."""
    side = SchedulerSide(*state_config(), settings(tmp_path))
    state_bytes_, kv_bytes = side.group_block_bytes
    assert state_bytes_ == 2 * STATE_BYTES
    assert side._hit_bytes(0, 1) == state_bytes_ + kv_bytes
    assert side._hit_bytes(0, 6) == state_bytes_ + 6 * kv_bytes
    side.close()
