"""The load policy (connector/scheduler/load_policy.py) on synthetic
measurements: its fits, its decisions, and that it never loads more when loads
get slower."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.connector.scheduler.load_policy import (
    LOAD,
    MIN_COMPUTE_SAMPLES,
    MIN_LOAD_SAMPLES,
    PROBE,
    PROBE_INTERVAL_S,
    RECOMPUTE,
    SHORTER,
    ComputeCosts,
    LoadCosts,
    LoadPolicy,
    nonnegative_fit,
)
from tests.support.load_policy import BLOCK_BYTES, BLOCK_TOKENS, Clock, measured_policy


@given(
    coef=st.lists(st.floats(0, 10), min_size=3, max_size=3),
    seed=st.integers(0, 1000),
)
@settings(max_examples=60, deadline=None)
def test_nonnegative_fit_recovers_nonnegative_coefficients(coef, seed):
    rng = np.random.default_rng(seed)
    columns = np.column_stack([np.ones(20), rng.uniform(0, 5, (20, 2))])
    y = columns @ np.array(coef)
    fit = nonnegative_fit(columns, y, np.ones(20))
    assert (fit >= 0).all()
    np.testing.assert_allclose(columns @ fit, y, rtol=1e-6, atol=1e-6)


def test_nonnegative_fit_never_returns_a_negative_cost():
    # more bytes took less time (noise): the slope is clamped to 0, not negative
    columns = np.column_stack([np.ones(4), [1.0, 2.0, 3.0, 4.0]])
    fit = nonnegative_fit(columns, np.array([4.0, 3.0, 2.0, 1.0]), np.ones(4))
    assert fit[1] == 0
    assert fit[0] == pytest.approx(2.5)


def test_load_costs_price_page_cache_and_disk_apart():
    costs = LoadCosts()
    for n in range(1, 7):  # cache 0.1 ms/MiB, disk 2 ms/MiB, 1 ms fixed
        costs.observe(0.001 + n * 0.0001, n << 20, 0)
        costs.observe(0.001 + n * 0.002, 0, n << 20)
        costs.observe(0.001 + n * 0.0021, n << 20, n << 20)
    fixed, per_cached, per_disk, _ = costs.fitted()
    assert fixed == pytest.approx(0.001, rel=1e-3)
    assert per_cached * (1 << 20) == pytest.approx(0.0001, rel=1e-3)
    assert per_disk * (1 << 20) == pytest.approx(0.002, rel=1e-3)
    assert costs.seconds(4 << 20, cached_bytes=4 << 20) == pytest.approx(0.0014)
    assert costs.seconds(4 << 20, cached_bytes=0) == pytest.approx(0.009)


def test_load_costs_without_disk_reads_price_everything_at_the_recent_mix():
    costs = LoadCosts()
    for n in range(1, 5):
        costs.observe(0.001 + n * 0.0001, n << 20, 0)
    # disk bytes were never seen: no cost of their own, the blended fit prices them
    assert costs.seconds(2 << 20, cached_bytes=0) == pytest.approx(0.0012)


def test_compute_costs_take_the_slope_and_fall_back_to_an_upper_bound():
    costs = ComputeCosts()
    for tokens in (32, 128, 512):
        costs.observe(0.005 + tokens * 1e-5, tokens)
    assert costs.per_token() == pytest.approx(1e-5)
    alike = ComputeCosts()  # decode steps only: the slope cannot be told
    for _ in range(8):
        alike.observe(0.005 + 8 * 1e-5, 8)
    assert alike.per_token() == pytest.approx((0.005 + 8e-5) / 8)


def test_few_measurements_load_every_hit_and_always_loads_regardless():
    slow = measured_policy(10.0, 1e-6, 1e-6)
    assert slow.decide(4, BLOCK_BYTES, BLOCK_TOKENS).kind == RECOMPUTE
    fresh = LoadPolicy("auto")
    fresh.observe_loads([(10.0, BLOCK_BYTES, 0)] * (MIN_LOAD_SAMPLES - 1))
    fresh.observe_steps([(0.001, 64)] * MIN_COMPUTE_SAMPLES)
    assert fresh.decide(4, BLOCK_BYTES, BLOCK_TOKENS).kind == LOAD
    always = measured_policy(10.0, 1e-6, 1e-6, mode="always")
    assert always.decide(4, BLOCK_BYTES, BLOCK_TOKENS).blocks == 4


def test_a_fixed_cost_makes_short_prefixes_recompute_and_long_ones_load():
    # 20 ms per load plus 1 ms per MiB block, against 0.1 ms per token (3.2 ms
    # a block): the fixed cost pays off from about 9 blocks with the margin
    policy = measured_policy(0.020, 1e-3 / BLOCK_BYTES, 1e-4)
    assert policy.decide(2, BLOCK_BYTES, BLOCK_TOKENS).kind == RECOMPUTE
    long = policy.decide(16, BLOCK_BYTES, BLOCK_TOKENS)
    assert (long.kind, long.blocks) == (LOAD, 16)
    assert long.load_s == pytest.approx(0.036)
    assert long.recompute_s == pytest.approx(0.0512)


def test_a_hit_joining_a_steps_load_pays_no_fixed_cost():
    # alone, 2 blocks pay the 20 ms fixed cost: recompute (6.4 ms) wins; in a
    # step that loads another hit already, they add 2 ms of bytes: load
    policy = measured_policy(0.020, 1e-3 / BLOCK_BYTES, 1e-4)
    assert policy.decide(2, BLOCK_BYTES, BLOCK_TOKENS).kind == RECOMPUTE
    joined = policy.decide(2, BLOCK_BYTES, BLOCK_TOKENS, joins=True)
    assert (joined.kind, joined.blocks) == (LOAD, 2)
    assert joined.load_s == pytest.approx(0.002)


def test_a_shorter_prefix_is_the_page_cached_head():
    policy = measured_policy(0.0, 1e-3 / BLOCK_BYTES, 1e-4)
    # disk reads cost 10 ms a block, cache reads 1 ms: recompute (3.2 ms) wins
    # for the disk part only
    policy.observe_loads((n * 0.010, 0, n * BLOCK_BYTES) for n in range(1, 9))
    policy.observe_loads((n * 0.010, 0, n * BLOCK_BYTES) for n in range(1, 9))
    asked = []

    def head() -> int:
        asked.append(True)
        return 5

    decision = policy.decide(12, BLOCK_BYTES, BLOCK_TOKENS, cached_head=head)
    assert (decision.kind, decision.blocks) == (SHORTER, 5)
    assert asked == [True]
    no_head = policy.decide(12, BLOCK_BYTES, BLOCK_TOKENS, cached_head=lambda: 0)
    assert no_head.kind == RECOMPUTE


def test_declining_probes_once_an_interval_and_a_fast_probe_restarts_the_fit():
    clock = Clock()
    policy = measured_policy(0.5, 0.0, 1e-5, clock=clock)  # 0.5 s a load
    assert policy.decide(4, BLOCK_BYTES, BLOCK_TOKENS).kind == RECOMPUTE
    clock.now += PROBE_INTERVAL_S
    assert policy.decide(4, BLOCK_BYTES, BLOCK_TOKENS).kind == PROBE
    assert policy.decide(4, BLOCK_BYTES, BLOCK_TOKENS).kind == RECOMPUTE  # one
    policy.observe_loads([(0.0001, 4 * BLOCK_BYTES, 0)])  # the probe was fast
    assert policy.loads.count == 1
    assert policy.decide(4, BLOCK_BYTES, BLOCK_TOKENS).kind == LOAD  # refilling
    clock.now += PROBE_INTERVAL_S
    slow_probe = measured_policy(0.5, 0.0, 1e-5, clock=clock)
    clock.now += PROBE_INTERVAL_S
    assert slow_probe.decide(4, BLOCK_BYTES, BLOCK_TOKENS).kind == PROBE
    slow_probe.observe_loads([(0.6, 4 * BLOCK_BYTES, 0)])  # still slow: keep the fit
    assert slow_probe.loads.count == 9
    assert slow_probe.decide(4, BLOCK_BYTES, BLOCK_TOKENS).kind == RECOMPUTE


@given(
    fixed=st.floats(0, 0.1),
    per_mib=st.floats(0, 0.05),
    slower=st.floats(1.0, 100.0),
    per_token=st.floats(1e-6, 1e-3),
    blocks=st.integers(1, 64),
    head=st.integers(0, 64),
)
@settings(max_examples=200, deadline=None)
def test_slower_loads_never_load_more(fixed, per_mib, slower, per_token, blocks, head):
    fast = measured_policy(fixed, per_mib / BLOCK_BYTES, per_token)
    slow = measured_policy(fixed * slower, per_mib * slower / BLOCK_BYTES, per_token)
    a = fast.decide(blocks, BLOCK_BYTES, BLOCK_TOKENS, cached_head=lambda: head)
    b = slow.decide(blocks, BLOCK_BYTES, BLOCK_TOKENS, cached_head=lambda: head)
    assert 0 <= b.blocks <= a.blocks <= blocks
    for decision in (a, b):  # what it loads, it expects to pay within the margin
        if decision.kind in (LOAD, SHORTER):
            assert decision.load_s <= 1.25 * decision.recompute_s + 1e-12
