"""The trace benchmark's simulators and generator (bench/harness/trace_sim.py,
bench/harness/trace_gen.py): OPT is an upper bound and the optimum on tiny
traces, LRU equals a naive reference, every cache stays prefix-closed, and
the generator's single-use share lands where it was asked; the store's
admission rules (simulate_auto) equal a naive reference, stay under OPT and
LRU's writes, and keep the ghost bounded. No timing."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bench.harness import trace_gen
from bench.harness.trace_sim import (
    block_key,
    simulate,
    simulate_auto,
    simulate_lru,
    simulate_opt,
    simulate_second_sight,
    simulate_second_sight_bounded,
)
from npukv_store.store import admission
from npukv_store.store.admission import AdmissionTuning

SIMS = (
    simulate_lru,
    simulate_second_sight,
    simulate_opt,
    simulate_auto,
    simulate_second_sight_bounded,
)
#: a sampling rate under 1 at these capacities (shadow_blocks / capacity),
#: small shadows and ghosts, a short window: every path of the rules runs
SMALL = AdmissionTuning(shadow_blocks=3, ghost_per_block=1.5, margin=0.1, window=2.0)
TUNINGS = st.sampled_from(
    [
        AdmissionTuning(),
        SMALL,
        AdmissionTuning(**{**vars(SMALL), "ghost_keeps_written": False}),
    ]
)


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
def test_opt_hits_at_least_as_many_as_every_other_policy(trace, capacity):
    opt = simulate_opt(trace, capacity)
    for sim in SIMS[:2] + SIMS[3:]:
        assert opt.hit_blocks >= sim(trace, capacity).hit_blocks, sim.__name__
    for tuning in (SMALL, AdmissionTuning(margin=0.0, window=1.0)):
        assert opt.hit_blocks >= simulate_auto(trace, capacity, None, tuning).hit_blocks


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


def naive_admission(
    trace: list[list[int]], capacity: int, tuning: AdmissionTuning, policy: str
) -> tuple[list[tuple[int, int]], int]:
    """simulate_auto the slow way: naive_lru's stamps, the sampling and the
    ghost in plain lists, admission.py's Shadow and rules; per request its
    hit and blocks written, and the ghost's peak."""
    prefix = {b: admission.key_prefix(block_key(b)) for c in trace for b in c}
    threshold = admission.sample_threshold(capacity, tuning)
    size = admission.shadow_capacity(capacity, tuning)
    keys = admission.MemoryKeys
    shadow = admission.Shadow(
        keys(), keys(), keys(), size, math.ceil(size * tuning.ghost_per_block), tuning
    )
    scores = admission.Scores()
    ghost: list[int] = []  # oldest first
    limit_ghost = admission.ghost_capacity(capacity, tuning)
    stamp: dict[int, tuple[int, int]] = {}
    out, peak = [], 0
    for i, chain in enumerate(trace):
        for block in chain:
            if prefix[block] < threshold:
                shadow.ask(prefix[block], scores)
        hit = 0
        while hit < len(chain) and chain[hit] in stamp:
            hit += 1
        save = [prefix[b] for b in chain[hit : min(len(chain), capacity)]]
        n = 0
        if save:
            mode = admission.choose_mode(policy, scores, 1.0, tuning, size)
            n = admission.admitted_run(mode, save, ghost.__contains__)
            if tuning.ghost_keeps_written:  # written blocks stay "seen"
                refreshed = save[:n]
            else:
                ghost = [k for k in ghost if k not in save[:n]]
                refreshed = []
            for key in refreshed + save[n:]:
                if key in ghost:
                    ghost.remove(key)
                ghost.append(key)
            ghost = ghost[max(0, len(ghost) - limit_ghost) :]
            peak = max(peak, len(ghost))
        while len(stamp) + n > capacity:
            victims = [b for b in stamp if b not in chain[:hit]]
            del stamp[min(victims, key=stamp.__getitem__)]
        for j in range(hit + n):
            stamp[chain[j]] = (i, len(chain) - j)
        out.append((hit, n))
    return out, peak


@settings(max_examples=200, deadline=None)
@given(
    trace=traces(),
    capacity=st.integers(1, 40),
    tuning=TUNINGS,
    policy=st.sampled_from(admission.POLICIES),
)
def test_admission_equals_a_naive_reference(trace, capacity, tuning, policy):
    result = simulate_auto(trace, capacity, None, tuning, policy, keep_hits=True)
    naive, peak = naive_admission(trace, capacity, tuning, policy)
    assert result.hits == [hit for hit, _ in naive]
    assert result.written_blocks == sum(new for _, new in naive)
    assert result.ghost_peak == peak <= admission.ghost_capacity(capacity, tuning)
    offered = sum(
        min(len(c), capacity) - h for c, h in zip(trace, result.hits, strict=True)
    )
    assert result.written_blocks + result.declined == max(offered, 0)


@settings(max_examples=200, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 40), tuning=TUNINGS)
def test_admission_all_is_lru_exactly(trace, capacity, tuning):
    lru = simulate_lru(trace, capacity, keep_hits=True)
    got = simulate_auto(trace, capacity, None, tuning, "all", keep_hits=True)
    assert got.hits == lru.hits
    assert got.written_blocks == lru.written_blocks
    assert got.declined == 0
    assert set(got.modes) <= {"ALL"}


@settings(max_examples=200, deadline=None)
@given(trace=traces(), capacity=st.integers(1, 40), tuning=TUNINGS)
def test_second_sight_writes_only_blocks_declined_before(trace, capacity, tuning):
    """In second sight every block written was in the ghost when its save
    came (declined before, asked again): written <= lost hits."""
    r = simulate_second_sight_bounded(trace, capacity, None, tuning)
    assert r.written_blocks <= r.lost_hits
    assert r.policy == "second_sight_bounded"
    assert set(r.modes) <= {"SECOND_SIGHT"}


def test_auto_writes_less_than_lru_where_blocks_are_used_once():
    """A hot prefix reused by every request, a fresh tail each time: once
    the shadows see the reuse, second sight wins (write-all's extra writes
    buy nothing), and auto writes the tails no more."""
    trace = [[0, 1, 2, 100 + i] for i in range(200)]
    lru = simulate_lru(trace, 8)
    auto = simulate("auto", trace, 8)
    assert auto.hit_blocks >= lru.hit_blocks - 3
    assert auto.written_blocks < lru.written_blocks / 8
    # write-all while the shadows warm up (8 asks), and while second
    # sight's shadow has yet to see a block a third time
    assert auto.modes["SECOND_SIGHT"] >= 175


def test_the_ghost_keeps_its_newest_declined_blocks():
    """Every block used once: second sight declines them all; the ghost holds
    the newest ghost_capacity (its floor, 64, here) and a block declined
    longer ago than that is declined again when it comes back."""
    tuning = AdmissionTuning(ghost_per_block=1.0)
    assert admission.ghost_capacity(4, tuning) == 64
    trace = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(100)]
    r = simulate_second_sight_bounded(trace, 4, None, tuning)
    assert r.written_blocks == 0
    assert r.declined == 300
    assert r.ghost_peak == 64
    recent = simulate_second_sight_bounded([*trace, trace[-1]], 4, None, tuning)
    assert recent.written_blocks == 3  # the last request's blocks: in the ghost
    old = simulate_second_sight_bounded([*trace, trace[0]], 4, None, tuning)
    assert old.written_blocks == 0  # the first's: dropped long ago
    assert old.lost_hits == 0


def test_block_key_is_the_benchmarks():
    assert block_key(0).hex() == (
        __import__("hashlib").blake2b(bytes(8), digest_size=16).hexdigest()
    )
    assert len({block_key(i) for i in range(1000)}) == 1000


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
    for every block and admission ``all``, the store hits each request's
    stored prefix exactly."""
    from bench.harness import trace_replay

    trace = trace_gen.generate(trace_gen.GenParams(requests=150, seed=5))
    rows = [(r.hash_ids, r.input_length) for r in trace]
    chains = [list(r.hash_ids) for r in trace]
    got = trace_replay._replay(
        str(tmp_path / "store"), 1 << 30, 10**6, 0.0, "never", "all", rows, 0, 1,
        0.0,
    )  # fmt: skip
    want = simulate_lru(chains, 10**6, [r.input_length for r in trace])
    assert got["verify_failures"] == 0
    assert got["read_misses"] == 0
    assert got["hit_blocks"] == want.hit_blocks > 0
    assert got["hit_tokens"] == want.hit_tokens
    assert got["written_blocks"] == want.written_blocks
    assert got["refused_blocks"] == got["stranded_blocks"] == 0


def test_the_stores_second_sight_is_its_simulation(tmp_path):
    """The store's admission (second sight, its ghost in LMDB, changes
    carried by each commit) writes and hits exactly what the simulation of
    the same rules over in-memory tables does, with room for every block."""
    from bench.harness import trace_replay

    trace = trace_gen.generate(trace_gen.GenParams(requests=200, seed=8))
    rows = [(r.hash_ids, r.input_length) for r in trace]
    chains = [list(r.hash_ids) for r in trace]
    blocks = 10**5
    got = trace_replay._replay(
        str(tmp_path / "store"), 1 << 30, blocks, 0.0, "never", "second_sight",
        rows, 0, 1, 0.0,
    )  # fmt: skip
    want = simulate("second_sight_bounded", chains, blocks, None)
    assert got["verify_failures"] == 0
    assert got["declined_blocks"] == want.declined > 0
    assert got["written_blocks"] == want.written_blocks > 0
    assert got["hit_blocks"] == want.hit_blocks > 0
