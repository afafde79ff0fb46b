"""What a hit search looks up (decision 0061): rank 0's keys one by one, the
other ranks' only at the ends of rank 0's save runs, and nothing on a retry;
and, whatever chunks each rank's saves made or lost, the hit is every rank's
common stored prefix."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from npukv_store import KVStore
from npukv_store.connector.scheduler.side import SchedulerSide
from tests.support.connector import (
    BLOCK,
    PAGE,
    engine_config,
    make_request,
    settings,
)

CHUNK = 8  # blocks per save


def _put(cfg, spec, keys: list[bytes]) -> None:
    with KVStore(cfg, spec) as store:
        rows = {
            f"{layer.name}.page": np.zeros((len(keys), PAGE), np.uint8)
            for layer in spec.layers
        }
        store.put(keys, rows)


def _store_everything(side, cfg, tokens, blocks: int) -> None:
    keys = side._keys(side._state(make_request("seed", tokens)), blocks)
    for rank, specs in enumerate(side.engine.specs):
        for start in range(0, blocks, CHUNK):
            _put(cfg, specs[0], keys[rank][0][start : start + CHUNK])


def _looked_up(side, request) -> tuple[int, int, int]:
    """(tokens claimed, lookups, keys looked up) of one match call."""
    before = side.store.counters.snapshot()
    claimed = side.match(request, 0)
    after = side.store.counters.snapshot()
    return (
        claimed,
        after["lookups"] - before["lookups"],
        after["lookup_blocks"] - before["lookup_blocks"],
    )


def test_keys_looked_up_do_not_grow_with_tp_and_a_retry_looks_up_none(tmp_path):
    blocks = 4 * CHUNK
    tokens = list(range(blocks * BLOCK + 1))
    looked: dict[int, int] = {}
    for tp in (1, 4):
        cfg = settings(tmp_path / f"tp{tp}")
        side = SchedulerSide(*engine_config(tp=tp), cfg)
        _store_everything(side, cfg, tokens, blocks)
        request = make_request("r", tokens)
        claimed, _, looked[tp] = _looked_up(side, request)
        assert claimed == blocks * BLOCK
        assert _looked_up(side, request) == (claimed, 0, 0)  # the retry
        side.close()
    # rank 0: every block; each other rank: both ends of each of 4 saves
    assert looked[1] == blocks
    assert looked[4] == blocks + 3 * 4 * 2


def test_a_retry_keeps_its_answer_and_a_new_request_sees_new_blocks(tmp_path):
    cfg = settings(tmp_path)
    side = SchedulerSide(*engine_config(tp=2), cfg)
    tokens = list(range(2 * CHUNK * BLOCK + 1))
    request = make_request("r", tokens)
    assert side.match(request, 0) == 0
    _store_everything(side, cfg, tokens, 2 * CHUNK)
    assert side.match(request, 0) == 0  # no lookup: vLLM asked again
    assert side.match(request, CHUNK * BLOCK) == 0
    assert side.match(make_request("r", tokens), 0) == 2 * CHUNK * BLOCK
    side.close()


def test_a_match_after_a_planned_load_looks_up_again(tmp_path):
    """A load that failed (its chunk quarantined, here removed) is not
    offered again: the match vLLM makes after the failure looks up afresh
    (a stale answer looped the corrupt-chunk run of Gemma 3 forever)."""
    cfg = settings(tmp_path)
    side = SchedulerSide(*engine_config(tp=1), cfg)
    tokens = list(range(2 * CHUNK * BLOCK + 1))
    _store_everything(side, cfg, tokens, 2 * CHUNK)
    request = make_request("r", tokens)
    claimed = side.match(request, 0)
    assert claimed == 2 * CHUNK * BLOCK
    side.allocated(request, ([*range(1, 2 * CHUNK + 1)],), claimed)
    index = side.store.index  # the load failed: its chunks are quarantined
    index.remove_chunks([r.chunk_id for r in index.iter_chunks()])
    again, lookups, _ = _looked_up(side, request)
    assert (again, lookups > 0) == (0, True)
    side.close()


TP = 3
BLOCKS = 10


@st.composite
def rank_saves(draw):
    """Per rank, its saves: runs of blocks (cut points of its own), each
    kept or lost (evicted, dropped), and maybe one overlapping save that
    repeats blocks another save holds."""
    saves = []
    for _ in range(TP):
        cuts = sorted(draw(st.sets(st.integers(1, BLOCKS - 1), max_size=4)))
        edges = [0, *cuts, BLOCKS]
        runs = [(a, b) for a, b in zip(edges, edges[1:], strict=False)]
        kept = [r for r in runs if draw(st.integers(0, 5))]  # mostly kept
        if draw(st.booleans()):
            start = draw(st.integers(0, BLOCKS - 2))
            kept.append((start, draw(st.integers(start + 1, BLOCKS))))
        saves.append(kept)
    return saves


@hyp_settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(saves=rank_saves())
def test_the_hit_is_every_ranks_common_stored_prefix(saves):
    tokens = list(range(7, 7 + BLOCKS * BLOCK + 1))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = settings(Path(tmp))
        side = SchedulerSide(*engine_config(tp=TP), cfg)
        keys = side._keys(side._state(make_request("seed", tokens)), BLOCKS)
        truth = BLOCKS
        for rank, runs in enumerate(saves):
            spec = side.engine.specs[rank][0]
            for start, stop in runs:
                _put(cfg, spec, keys[rank][0][start:stop])
            with KVStore(cfg, spec) as store:  # the oracle: every key
                truth = min(truth, store.lookup(keys[rank][0]))
        assert side.match(make_request("r", tokens), 0) == truth * BLOCK
        side.close()


def test_the_schedulers_lookups_feed_the_admission_shadow(tmp_path):
    """auto's shadow must see vLLM's requests: the scheduler's hit search
    (not KVStore.lookup) hands each request's chain to the admitter once (a
    retry adds nothing), and the touch flush applies it to the shared
    shadow. Without it the shadows never warm up and auto writes all."""
    cfg = settings(tmp_path, capacity="1MiB")
    side = SchedulerSide(*engine_config(tp=2), cfg)
    assert side.store.admitter.capacity_blocks <= 4096  # every key sampled
    tokens = list(range(2 * CHUNK * BLOCK + 1))
    request = make_request("r", tokens)
    side.match(request, 0)
    side.match(request, 0)  # vLLM asks again: no second lookup
    side.store.flush_touches()
    report = side.store.index.admission_report()
    sampled = side.store.admitter._sampled(side._state(request).links[0])
    assert len(sampled) == 2 * CHUNK
    assert report["shadow_asks"] == len(sampled)
    assert len(side.store.admitter.shadow.every) == len(set(sampled))
    side.close()
