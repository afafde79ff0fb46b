"""Load or recompute, end to end through the connector's two halves: the
worker measures real loads from a store slowed by injected delays (each read
of the slow worker's store held SLOW_READ_S first: these small rows are read
from the page cache, which NPUKV_FAULTS' engine-level delays do not touch) and
real step times, the scheduler side decides from them, and its stats count
each decision. No vLLM engine: its objects are the stand-ins of
tests/support/connector.py."""

from __future__ import annotations

import logging
import time

import pytest

from npukv_store.connector.metadata import NPUKVMetadata
from npukv_store.connector.scheduler.load_policy import (
    MIN_LOAD_SAMPLES,
    PROBE_INTERVAL_S,
    LoadPolicy,
)
from npukv_store.connector.scheduler.side import SchedulerSide
from npukv_store.connector.worker.side import WorkerSide
from tests.support.connector import (
    BLOCK,
    cpu_caches,
    engine_config,
    make_request,
    put_blocks,
    settings,
    transfer,
)
from tests.support.load_policy import Clock, measured_policy

pytestmark = pytest.mark.integration

BLOCKS = 8
#: compute "costs" 1 ms a token (a sleep inside the step): recomputing the
#: 8-block hit takes 128 ms, a slowed load (0.4 s a read) far longer, a plain
#: load of its 48 KiB under a few ms
PER_TOKEN_S = 1e-3
SLOW_READ_S = 0.4


def _worker(tmp_path, monkeypatch, delay_s: float = 0.0, **kw) -> WorkerSide:
    """A worker; with ``delay_s``, each read of its store waits that long."""
    worker = WorkerSide(*engine_config(), settings(tmp_path, **kw))
    worker.register(cpu_caches(seed=3))
    assert worker.disabled_reason == ""
    for store in worker.stores if delay_s else ():
        for name in ("read", "read_many"):
            monkeypatch.setattr(store, name, _delayed(getattr(store, name), delay_s))
    return worker


def _delayed(read, delay_s: float):
    def slow_read(*args, **kwargs):
        time.sleep(delay_s)
        return read(*args, **kwargs)

    return slow_read


def _step(side: SchedulerSide, worker: WorkerSide, loads=(), tokens: int = 0):
    """One forward: the loads, then ``tokens`` of compute; its costs go back."""
    worker.bind(NPUKVMetadata(loads=list(loads), num_scheduled_tokens=tokens))
    worker.start_load()
    time.sleep(tokens * PER_TOKEN_S)
    worker.finish_step()
    assert worker.take_load_errors() == set()
    side.measured(*worker.take_costs())


def _ask(side: SchedulerSide, request) -> int:
    """The scheduler's hit for ``request`` and its load plan: blocks claimed."""
    tokens = side.match(request, 0)
    side.allocated(request, (list(range(1, BLOCKS + 1)),), tokens)
    side._loads.pop(request.request_id, None)
    return tokens // BLOCK


def _save_and_compute(side: SchedulerSide, worker: WorkerSide, blocks) -> None:
    """Store ``blocks`` (the transfers a hit loads), then run prefill steps
    that load nothing, so the policy knows what compute costs."""
    worker.bind(NPUKVMetadata(saves=list(blocks)))
    worker.finish_step()
    assert worker.store is not None
    assert worker.store.flush(timeout_s=30)
    for tokens in (4, 16, 64) * 3:
        _step(side, worker, tokens=tokens)


def _serve_hits(side, worker, request, load, times: int) -> list[int]:
    """Ask ``times`` for the hit of ``request``; load what is claimed."""
    claims = []
    for _ in range(times):
        claims.append(_ask(side, request))
        if claims[-1]:
            _step(side, worker, loads=load)
    return claims


def test_the_decision_follows_the_measured_load_speed(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="npukv_store.connector.scheduler.load_policy")
    cfg = settings(tmp_path)
    side = SchedulerSide(*engine_config(), cfg)
    clock = Clock()
    side.policy = LoadPolicy(cfg.load_policy, cfg.load_margin, clock=clock)
    request = make_request("r", list(range(BLOCKS * BLOCK + 3)))
    keys = side._keys(side._state(request), BLOCKS)[0][0]
    ids = list(range(1, BLOCKS + 1))
    load = [transfer(keys, ids)]

    fast = _worker(tmp_path, monkeypatch)
    _save_and_compute(side, fast, load)

    slow = _worker(tmp_path, monkeypatch, SLOW_READ_S)
    decisions = _serve_hits(side, slow, request, load, MIN_LOAD_SAMPLES + 2)
    # unmeasured: it loads; then the slow loads it measured turn it to recompute
    assert decisions == [BLOCKS] * MIN_LOAD_SAMPLES + [0, 0]
    stats = side.take_stats().data
    assert stats["decided_load"] == MIN_LOAD_SAMPLES
    assert stats["decided_recompute"] == 2
    assert stats["declined_tokens"] == 2 * BLOCKS * BLOCK
    assert side.policy.decide(BLOCKS, side._hit_bytes(0, 1), BLOCK).load_s > 0.4
    turns = [r.getMessage() for r in caplog.records if "load policy" in r.getMessage()]
    assert len(turns) == 1
    assert "declining hits" in turns[0]

    # the disk is fast again: the next probe measures it and loads resume
    clock.now += PROBE_INTERVAL_S
    assert _ask(side, request) == BLOCKS
    _step(side, fast, loads=load)
    decisions = _serve_hits(side, fast, request, load, MIN_LOAD_SAMPLES + 2)
    assert decisions == [BLOCKS] * (MIN_LOAD_SAMPLES + 2)
    stats = side.take_stats().data
    assert stats["decided_probe"] == 1
    assert stats["decided_load"] == MIN_LOAD_SAMPLES + 2
    assert stats["decided_recompute"] == 0
    assert side.policy.measured()
    estimate = side.policy.decide(BLOCKS, side._hit_bytes(0, 1), BLOCK)
    assert estimate.load_s < 0.2 * estimate.recompute_s
    for worker in (fast, slow):
        worker.close()
    side.close()


def test_load_policy_always_loads_the_slow_hit(tmp_path, monkeypatch):
    cfg = settings(tmp_path, load_policy="always")
    side = SchedulerSide(*engine_config(), cfg)
    request = make_request("r", list(range(BLOCKS * BLOCK + 3)))
    keys = side._keys(side._state(request), BLOCKS)[0][0]
    ids = list(range(1, BLOCKS + 1))
    slow = _worker(tmp_path, monkeypatch, SLOW_READ_S / 4, load_policy="always")
    load = [transfer(keys, ids)]
    _save_and_compute(side, slow, load)
    hits = _serve_hits(side, slow, request, load, MIN_LOAD_SAMPLES + 1)
    assert hits == [BLOCKS] * (MIN_LOAD_SAMPLES + 1)
    assert side.take_stats().data["decided_load"] == MIN_LOAD_SAMPLES + 1
    slow.close()
    side.close()


def test_a_short_hit_loads_when_its_step_loads_another(tmp_path):
    """A step's loads run as one job: a hit whose load alone would not pay its
    fixed cost loads when an earlier hit of the same scheduling pass loads."""
    cfg = settings(tmp_path)
    side = SchedulerSide(*engine_config(), cfg)
    # 2 ms a load plus 0.01 ms a block, against 0.256 ms to recompute a block
    side.policy = measured_policy(0.002, 1e-5 / side._hit_bytes(0, 1), 1.6e-5)
    long, short, alone = (
        make_request(name, [n] * (blocks * BLOCK + 1))
        for name, n, blocks in (("long", 7, 8), ("short", 8, 1), ("alone", 9, 1))
    )
    for request, blocks in ((long, 8), (short, 1), (alone, 1)):
        keys = side._keys(side._state(request), blocks)[0][0]
        put_blocks(cfg, side.engine.specs[0][0], keys)
    for request, blocks in ((long, 8), (short, 1)):  # one scheduling pass
        # long: 2.08 ms against 2.05 ms (x 1.25); short joins it: 0.01 ms
        tokens = side.match(request, 0)
        assert tokens == blocks * BLOCK, request.request_id
        side.allocated(request, (list(range(1, blocks + 1)),), tokens)
    side._loads.clear()  # the step's metadata was built: the next pass
    assert side.match(alone, 0) == 0  # alone: 2.01 ms against 0.256 ms
    side.close()
