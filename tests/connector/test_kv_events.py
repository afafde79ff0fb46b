"""KV cache events of the NVMe tier (docs/decisions/0066), through the
scheduler half without an engine: saved blocks are announced under vLLM's
block hashes once the index holds them, loaded blocks at once, and each
announced block that leaves the directory (by any process) is withdrawn,
once. The real-vLLM run, with vLLM's own publisher and decoder, is
tests/e2e/test_kv_events.py."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from npukv_store.connector.scheduler import events as events_module
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.vllm_api import ManagerBlockIds
from npukv_store.store import index as index_module
from tests.support.connector import (
    BLOCK,
    engine_config,
    make_request,
    put_blocks,
    settings,
)

pytest.importorskip("vllm.distributed.kv_events")
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402


def ext(hashes):
    """vLLM's own event form of block hashes (ints by default)."""
    return [maybe_convert_block_hash(h) for h in hashes]


def events_config(**kw):
    vllm_config, kv_cache_config = engine_config(**kw)
    vllm_config.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    return vllm_config, kv_cache_config


def hashed_request(req_id: str, num_blocks: int, extra: int = 5):
    """A request with vLLM-like block hashes (a chain of 32-byte digests)."""
    tokens = [(7 * i + len(req_id)) % 2999 for i in range(num_blocks * BLOCK + extra)]
    request = make_request(req_id, tokens)
    parent = b""
    request.block_hashes = []
    for b in range(num_blocks):
        parent = hashlib.sha256(
            parent + str(tokens[b * BLOCK : (b + 1) * BLOCK]).encode()
        ).digest()
        request.block_hashes.append(parent)
    return request


def saving_side(tmp_path, **kw):
    side = SchedulerSide(*events_config(), settings(tmp_path, **kw))
    assert side.events is not None
    ids = list(range(10, 20))
    side.block_ids = ManagerBlockIds(SimpleNamespace(get_block_ids=lambda rid: (ids,)))
    return side, ids


def save_step(side, request):
    side.match(request, 0)
    side.allocated(request, (list(range(10, 20)),), 0)
    return side.build_meta(
        SimpleNamespace(num_scheduled_tokens={request.request_id: request.num_tokens})
    )


def stored(events):
    return [e for e in events if isinstance(e, BlockStored)]


def removed(events):
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_kv_event_a_save_is_announced_once_the_index_holds_it(tmp_path):
    side, _ = saving_side(tmp_path)
    request = hashed_request("r", 4)
    meta = save_step(side, request)
    keys = meta.saves[0].keys(0)
    assert len(keys) == 4
    assert side.take_events() == []  # planned, not written: nothing yet
    put_blocks(settings(tmp_path), side.engine.specs[0][0], keys[:3])  # the writer
    (event,) = stored(side.take_events())
    assert event.block_hashes == ext(request.block_hashes[:3])
    assert event.parent_block_hash is None
    assert event.token_ids == request.all_token_ids[: 3 * BLOCK]
    assert event.block_size == BLOCK
    assert event.medium == "STORAGE"
    assert event.group_idx == 0
    put_blocks(settings(tmp_path), side.engine.specs[0][0], keys[3:])
    (event,) = stored(side.take_events())
    assert event.block_hashes == ext(request.block_hashes[3:])
    assert event.parent_block_hash == ext(request.block_hashes)[2]
    assert side.take_events() == []  # announced once
    side.close()


def test_kv_event_a_dropped_save_is_never_announced(tmp_path, monkeypatch):
    monkeypatch.setattr(events_module, "GIVE_UP_S", 0.0)
    side, _ = saving_side(tmp_path)
    save_step(side, hashed_request("r", 3))
    assert side.take_events() == []  # not in the index: given up
    assert side.events._pending == []
    side.close()


def test_kv_event_blocks_that_leave_the_directory_are_withdrawn_once(tmp_path):
    side, _ = saving_side(tmp_path, kv_events_medium="NVME")
    request = hashed_request("r", 3)
    keys = save_step(side, request).saves[0].keys(0)
    put_blocks(settings(tmp_path), side.engine.specs[0][0], keys)
    assert stored(side.take_events())[0].medium == "NVME"
    # another process's eviction: the directory empties under this server
    other = SchedulerSide(*events_config(), settings(tmp_path))
    other.store.index.evict(1 << 40, young_after_ns=1 << 62)
    events = side.take_events()
    assert sorted(removed(events)) == sorted(ext(request.block_hashes))
    assert {e.medium for e in events} == {"NVME"}
    assert side.take_events() == []
    other.close()
    side.close()


def test_kv_event_a_reader_that_missed_removals_withdraws_everything(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(index_module, "REMOVED_LOG_ENTRIES", 2)
    side, _ = saving_side(tmp_path)
    first = hashed_request("a", 2)
    keys = save_step(side, first).saves[0].keys(0)
    put_blocks(settings(tmp_path), side.engine.specs[0][0], keys)
    assert stored(side.take_events())
    index = side.store.index
    for chunk in list(index.iter_chunks()):  # three removals: one more than kept
        index.remove_chunks([chunk.chunk_id])
    for i in range(3):
        put_blocks(settings(tmp_path), side.engine.specs[0][0], [bytes([i]) * 16])
        index.remove_chunks([c.chunk_id for c in index.iter_chunks()])
    assert sorted(removed(side.take_events())) == sorted(ext(first.block_hashes))
    assert side.events._tracked == {}
    side.close()


def test_kv_event_loaded_blocks_are_announced_at_once(tmp_path):
    side = SchedulerSide(*events_config(), settings(tmp_path))
    request = hashed_request("r", 4)
    keys = side._keys(side._state(request), 4)[0][0]
    put_blocks(settings(tmp_path), side.engine.specs[0][0], keys)
    assert side.match(request, 0) == 4 * BLOCK
    side.allocated(request, (list(range(10, 16)),), 4 * BLOCK)
    (event,) = stored(side.take_events())
    assert event.block_hashes == ext(request.block_hashes)
    side.close()


def test_kv_event_announced_blocks_are_bounded(tmp_path, monkeypatch):
    """Beyond MAX_TRACKED the oldest announced block is withdrawn: a router
    never keeps a block this server could no longer withdraw."""
    monkeypatch.setattr(events_module, "MAX_TRACKED", 2)
    side = SchedulerSide(*events_config(), settings(tmp_path))
    request = hashed_request("r", 4)
    keys = side._keys(side._state(request), 4)[0][0]
    put_blocks(settings(tmp_path), side.engine.specs[0][0], keys)
    side.match(request, 0)
    side.allocated(request, (list(range(10, 16)),), 4 * BLOCK)
    events = side.take_events()
    assert removed(events) == ext(request.block_hashes[:2])
    side.close()


def test_kv_events_are_off_unless_vllm_publishes_them(tmp_path):
    side = SchedulerSide(*engine_config(), settings(tmp_path))
    assert side.events is None
    assert side.take_events() == []
    side.close()
