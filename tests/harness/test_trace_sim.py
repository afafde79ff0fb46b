"""The trace benchmark's simulators and generator (bench/harness/trace_sim.py,
bench/harness/trace_gen.py): OPT is an upper bound and the optimum on tiny
traces, LRU equals a naive reference, every cache stays prefix-closed, and
the generator's single-use share lands where it was asked. No timing."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bench.harness import trace_gen
from bench.harness.trace_sim import (
    simulate_lru,
    simulate_opt,
    simulate_second_sight,
)

SIMS = (simulate_lru, simulate_second_sight, simulate_opt)


@st.composite
def traces(draw, max_requests=30, max_extend=5):
    """Prefix-sharing chains: each request takes a prefix of an earlier one
    (or nothing) and adds fresh blocks, so a block id implies its prefix."""
    steps = draw(
        st.lists(
            st.tuples(
                st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, max_extend)
            ),
            min_size=1,
            max_size=max_requests,
        )
    )
    chains: list[list[int]] = []
    fresh = itertools.count()
    for pick, cut, extend in steps:
        base: list[int] = []
        if chains:
            earlier = chains[pick % len(chains)]
            base = earlier[: cut % (len(earlier) + 1)]
        chain = base + [next(fresh) for _ in range(extend)]
        if not chain:
            chain = [next(fresh)]
        chains.append(chain)
    return chains


def parents(trace: list[list[int]]) -> dict[int, int | None]:
    """block -> its parent (None for a root)."""
    out: dict[int, int | None] = {}
    for chain in trace:
        for j, block in enumerate(chain):
            out[block] = chain[j - 1] if j else None
    return out


@settings(max_examples=300, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 40))
def test_opt_hits_at_least_as_many_as_lru_and_second_sight(trace, capacity):
    opt = simulate_opt(trace, capacity)
    assert opt.hit_blocks >= simulate_lru(trace, capacity).hit_blocks
    assert opt.hit_blocks >= simulate_second_sight(trace, capacity).hit_blocks


def brute_force(trace: list[list[int]], capacity: int) -> int:
    """The most prefix hits any offline policy gets: after each request the
    cache may become any set of at most ``capacity`` blocks out of what it
    held and what the request brought."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for chain in trace:
        after: dict[frozenset[int], int] = {}
        for held, score in best.items():
            hit = 0
            while hit < len(chain) and chain[hit] in held:
                hit += 1
            pool = sorted(held | set(chain))
            for size in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    state = frozenset(keep)
                    if after.get(state, -1) < score + hit:
                        after[state] = score + hit
        best = after
    return max(best.values())


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)
@given(trace=traces(max_requests=7, max_extend=2), capacity=st.integers(1, 3))
def test_opt_is_the_optimum_on_tiny_traces(trace, capacity):
    assume(len({b for chain in trace for b in chain}) <= 7)  # 2^blocks states
    assert simulate_opt(trace, capacity).hit_blocks == brute_force(trace, capacity)


def naive_lru(
    trace: list[list[int]], capacity: int, second_sight: bool = False
) -> list[tuple[int, int]]:
    """Block-level LRU the slow way: a use stamp per block (a request uses
    its chain deepest first, its root last), the victim the least stamp
    outside the request's hit; per request its hit and blocks written.
    ``second_sight``: a missed block is written only if it was missed
    before, and only up to the first that was not."""
    stamp: dict[int, tuple[int, int]] = {}
    missed: set[int] = set()
    out = []
    for i, chain in enumerate(trace):
        hit = 0
        while hit < len(chain) and chain[hit] in stamp:
            hit += 1
        limit = min(len(chain), capacity)
        if second_sight:
            for j in range(hit, limit):
                if chain[j] not in missed:
                    limit = j
                    break
            missed.update(b for b in chain[hit:] if b not in stamp)
        new = limit - hit
        while len(stamp) + new > capacity:
            victims = [b for b in stamp if b not in chain[:hit]]
            del stamp[min(victims, key=stamp.__getitem__)]
        for j in range(limit):
            stamp[chain[j]] = (i, len(chain) - j)
        out.append((hit, new))
    return out


@settings(max_examples=300, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 40))
def test_lru_and_second_sight_equal_a_naive_reference(trace, capacity):
    for sim, second in ((simulate_lru, False), (simulate_second_sight, True)):
        result = sim(trace, capacity, keep_hits=True)
        naive = naive_lru(trace, capacity, second_sight=second)
        assert result.hits == [hit for hit, _ in naive], sim.__name__
        assert result.written_blocks == sum(new for _, new in naive), sim.__name__


def test_second_sight_writes_a_block_on_its_second_miss():
    trace = [[1, 2], [1, 2], [1, 2, 3], [1, 2, 3], [1, 2, 3]]
    result = simulate_second_sight(trace, 10, keep_hits=True)
    assert result.hits == [0, 0, 2, 2, 3]
    assert result.written_blocks == 3
    assert simulate_lru(trace, 10, keep_hits=True).hits == [0, 2, 2, 3, 3]


@pytest.mark.parametrize("sim", SIMS, ids=lambda s: s.__name__)
@settings(max_examples=200, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 40))
def test_every_cache_stays_prefix_closed(sim, trace, capacity):
    parent = parents(trace)

    def closed(cached: set[int]) -> None:
        assert len(cached) <= capacity
        orphans = [b for b in cached if parent[b] not in (None, *cached)]
        assert not orphans, f"cached without their parent: {orphans}"

    sim(trace, capacity, check=closed)


@settings(max_examples=100, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 40))
def test_ratios_are_consistent(trace, capacity):
    for sim in SIMS:
        r = sim(trace, capacity, [600] * len(trace))
        assert 0 <= r.hit_blocks <= r.requested_blocks
        assert r.requested_blocks == sum(len(c) for c in trace)
        assert 0.0 <= r.token_hit_ratio <= 1.0
    big = simulate_lru(trace, 10**6)
    seen: set[int] = set()
    want = 0
    for chain in trace:
        hit = 0
        while hit < len(chain) and chain[hit] in seen:
            hit += 1
        want += hit
        seen.update(chain)
    assert big.hit_blocks == want


@pytest.mark.parametrize("target", [0.6, 0.76, 0.85])
def test_generator_single_use_share_lands_near_the_target(target):
    params = trace_gen.GenParams(requests=1500, single_use=target, seed=7)
    trace = trace_gen.generate(params)
    assert len(trace) == 1500
    share = trace_gen.single_use_share(r.hash_ids for r in trace)
    assert abs(share - target) < 0.03, share


def test_generator_chains_share_prefixes_and_round_trip(tmp_path):
    trace = trace_gen.generate(trace_gen.GenParams(requests=400, seed=3))
    parent: dict[int, int | None] = {}
    for r in trace:  # a block id implies its prefix: one parent per block
        for j, block in enumerate(r.hash_ids):
            want = r.hash_ids[j - 1] if j else None
            assert parent.setdefault(block, want) == want
        assert len(r.hash_ids) == -(-r.input_length // 512)
    assert [r.timestamp for r in trace] == sorted(r.timestamp for r in trace)
    path = tmp_path / "t.jsonl"
    trace_gen.write_trace(path, trace)
    assert trace_gen.read_trace(path) == trace
    assert json.loads(path.read_text().splitlines()[0])["hash_ids"][0] == 0


def test_read_trace_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*expected a JSON object"):
        trace_gen.read_trace(path)


def test_the_store_replay_hits_what_an_unbounded_cache_hits(tmp_path):
    """bench/trace.py's replay through KVStore, every read verified: with room
    for every block, the store hits each request's stored prefix exactly."""
    from bench import trace as bench_trace

    trace = trace_gen.generate(trace_gen.GenParams(requests=150, seed=5))
    rows = [(r.hash_ids, r.input_length) for r in trace]
    chains = [list(r.hash_ids) for r in trace]
    got = bench_trace._replay(
        str(tmp_path / "store"), 1 << 30, 10**6, 0.0, "never", rows, 0, 1, 0.0
    )
    want = simulate_lru(chains, 10**6, [r.input_length for r in trace])
    assert got["verify_failures"] == 0
    assert got["read_misses"] == 0
    assert got["hit_blocks"] == want.hit_blocks > 0
    assert got["hit_tokens"] == want.hit_tokens
    assert got["written_blocks"] == want.written_blocks
    assert got["refused_blocks"] == got["stranded_blocks"] == 0
