"""The store's policy rules, without LMDB or files: eviction, compaction
candidates and page-cache admission (npukv_store/store/policy.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from npukv_store.store import policy

lru_entries = st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(1, 10**4)),  # last ns, size
    max_size=30,
)


T = b"t" * 8  # one tenant without a share: plain LRU


def lru_pick(lru, size_of, excess, young_after_ns):
    """One tenant without shares: the victims, or None when not covered."""
    victims, covered = policy.pick_victims(
        {T: lru}, size_of, excess, young_after_ns, {T: 1 << 60}, {}, T
    )
    return victims if covered else None


@given(entries=lru_entries, excess=st.integers(-10, 10**5), cut=st.integers(0, 10**6))
def test_victims_are_the_oldest_prefix_that_covers_the_excess(entries, excess, cut):
    entries = sorted(entries)
    sizes = {cid: size for cid, (_, size) in enumerate(entries)}
    lru = [(last, cid) for cid, (last, _) in enumerate(entries)]
    victims = lru_pick(iter(lru), sizes.__getitem__, excess, cut)
    # Oracle: the shortest oldest-first prefix of old-enough chunks whose sizes
    # reach the excess; None if there is none.
    expected, freed = None, 0
    if excess <= 0:
        expected = []
    else:
        for n, (last, cid) in enumerate(lru, 1):
            if last > cut:
                break
            freed += sizes[cid]
            if freed >= excess:
                expected = [c for _, c in lru[:n]]
                break
    assert victims == expected


def test_a_young_chunk_stops_eviction_even_if_older_ones_cannot_cover():
    lru = [(1, 10), (2, 11), (9, 12)]
    assert lru_pick(iter(lru), lambda c: 5, 12, young_after_ns=5) is None
    assert lru_pick(iter(lru), lambda c: 5, 10, young_after_ns=5) == [10, 11]


def test_victims_read_the_lru_lazily():
    consumed = []

    def lru():
        for i in range(100):
            consumed.append(i)
            yield (i, i)

    assert lru_pick(lru(), lambda c: 10, 15, young_after_ns=1000) == [0, 1]
    assert consumed == [0, 1]


# -- tenants: docs/decisions/0067 --------------------------------------------------

TENANTS = [bytes([i]) * 8 for i in range(4)]


@st.composite
def tenant_directories(draw):
    """Chunks of up to four tenants (each one LRU run), their shares, a
    committer, an excess and a grace cut."""
    chunks = draw(
        st.lists(
            st.tuples(
                st.sampled_from(TENANTS),
                st.integers(0, 1000),  # last access
                st.integers(1, 100),  # size
            ),
            max_size=40,
        )
    )
    runs: dict[bytes, list[tuple[int, int]]] = {}
    sizes, owner = {}, {}
    for cid, (tenant, last, size) in enumerate(chunks):
        runs.setdefault(tenant, []).append((last, cid))
        sizes[cid], owner[cid] = size, tenant
    for run in runs.values():
        run.sort()
    usage = {t: sum(sizes[c] for _, c in run) for t, run in runs.items()}
    shares = draw(
        st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 600), max_size=4)
    )
    committer = draw(st.sampled_from([*TENANTS, None]))
    return runs, sizes, owner, usage, shares, committer


@given(
    directory=tenant_directories(),
    excess=st.integers(1, 2000),
    cut=st.integers(0, 1000),
)
def test_no_tenant_under_its_share_loses_a_block_for_another(directory, excess, cut):
    runs, sizes, owner, usage, shares, committer = directory
    victims, covered = policy.pick_victims(
        {t: iter(run) for t, run in runs.items()},
        sizes.__getitem__, excess, cut, usage, shares, committer,
    )  # fmt: skip
    left = dict(usage)
    for cid in victims:
        tenant = owner[cid]
        if tenant != committer:
            # the rule itself: taken only while its tenant is over its share
            assert left[tenant] > shares.get(tenant, 0), (cid, left, shares)
        left[tenant] -= sizes[cid]
    assert len(set(victims)) == len(victims)
    freed = sum(sizes[c] for c in victims)
    assert covered == (freed >= excess)
    if covered:  # no more than needed: the last victim was needed
        assert freed - sizes[victims[-1]] < excess
    # Old enough, and each tenant's victims are its oldest chunks, in order.
    by_tenant: dict[bytes, list[int]] = {}
    for cid in victims:
        by_tenant.setdefault(owner[cid], []).append(cid)
    for tenant, taken in by_tenant.items():
        assert taken == [c for _, c in runs[tenant][: len(taken)]]
        assert all(last <= cut for last, c in runs[tenant] if c in taken)
    # The committer's own chunks under its share go only when the tenants
    # over their share have no old-enough chunk left to give.
    own_under = [
        c for c in victims
        if owner[c] == committer and _left_before(c, victims, usage, sizes, owner)
        <= shares.get(committer, 0)
    ]  # fmt: skip
    if own_under:
        for tenant, run in runs.items():
            if tenant == committer:
                continue
            spare = left[tenant] - shares.get(tenant, 0)
            untaken = [c for last, c in run if last <= cut and c not in victims]
            assert spare <= 0 or not untaken, (tenant, spare, untaken)


def _left_before(cid, victims, usage, sizes, owner):
    """The bytes ``cid``'s tenant held just before ``cid`` was taken."""
    tenant = owner[cid]
    held = usage[tenant]
    for other in victims:
        if other == cid:
            return held
        if owner[other] == tenant:
            held -= sizes[other]
    raise AssertionError(cid)


def test_a_tenant_over_its_share_goes_first_even_when_younger():
    runs = {TENANTS[0]: [(1, 1), (2, 2)], TENANTS[1]: [(5, 3), (6, 4)]}
    sizes = dict.fromkeys(range(1, 5), 10)
    usage = {TENANTS[0]: 20, TENANTS[1]: 20}
    shares = {TENANTS[0]: 20}  # tenant 0 is at its share; tenant 1 has none
    victims, covered = policy.pick_victims(
        runs, sizes.__getitem__, 15, 100, usage, shares, TENANTS[1]
    )
    assert (victims, covered) == ([3, 4], True)
    # Another tenant's commit cannot take tenant 0's reserved chunks either.
    victims, covered = policy.pick_victims(
        runs, sizes.__getitem__, 30, 100, usage, shares, TENANTS[2]
    )
    assert (victims, covered) == ([3, 4], False)


def test_excess_bytes_over_a_target_fraction():
    assert policy.excess_bytes(900, 1000, 0.8) == 100
    assert policy.excess_bytes(700, 1000, 0.8) == -100
    with pytest.raises(ValueError, match="expected 0..1"):
        policy.excess_bytes(1, 1, 1.5)


@dataclass(frozen=True)
class Chunk:  # what policy.ChunkFacts asks for; the index's ChunkRecord has it too
    chunk_id: int
    namespace: bytes
    size_bytes: int
    num_rows: int
    live_rows: int
    created_ns: int
    tenant: bytes = bytes(8)
    pinned: bool = False


def _facts(cid, ns=b"a" * 16, size=1000, rows=10, live=10, created=0):
    return Chunk(cid, ns, size, rows, live, created)


facts_lists = st.lists(
    st.builds(
        _facts,
        cid=st.integers(1, 10**9),
        ns=st.sampled_from([b"a" * 16, b"b" * 16]),
        size=st.integers(4096, 200_000),
        rows=st.integers(1, 50),
        live=st.integers(0, 50),
        created=st.integers(0, 10**6),
    ).filter(lambda f: f.live_rows <= f.num_rows),
    unique_by=lambda f: f.chunk_id,
    max_size=40,
)


@given(chunks=facts_lists, min_live=st.floats(0, 1))
def test_rewrite_candidates_are_exactly_those_below_the_live_fraction(chunks, min_live):
    picked = {c.chunk_id for c in policy.rewrite_candidates(chunks, min_live)}
    assert picked == {c.chunk_id for c in chunks if c.live_rows / c.num_rows < min_live}


@given(chunks=facts_lists, target=st.integers(10_000, 1_000_000))
def test_merge_groups_stay_in_one_namespace_in_creation_order_within_target(
    chunks, target
):
    groups = policy.merge_groups(chunks, target)
    seen = [c.chunk_id for g in groups for c in g]
    assert len(seen) == len(set(seen)), "a chunk in two groups"
    for group in groups:
        assert len({c.namespace for c in group}) == 1
        order = [(c.created_ns, c.chunk_id) for c in group]
        assert order == sorted(order)
        assert all(c.size_bytes < target / 2 for c in group)
        live = sum(c.size_bytes * c.live_rows // c.num_rows for c in group)
        # only a group's last member may push it past the target
        assert len(group) == 1 or live - _live(group[-1]) <= target
        assert len(group) > 1 or group[0].live_rows < group[0].num_rows


def _live(c):
    return c.size_bytes * c.live_rows // c.num_rows


def test_merge_groups_leaves_large_and_lone_full_chunks_alone():
    big = _facts(1, size=900)
    lone = _facts(2, size=100)
    assert policy.merge_groups([big, lone], target_bytes=1000) == []
    pair = [_facts(3, size=100, created=1), _facts(4, size=100, created=2)]
    assert policy.merge_groups([*pair, big], 1000) == [pair]


def test_admission_the_second_read_fills_the_page_cache():
    assert policy.admit_on_read(read_before=False) is False
    assert policy.admit_on_read(read_before=True) is True


def test_compaction_leaves_pinned_chunks_and_keeps_tenants_apart():
    pinned = Chunk(1, b"a" * 16, 1000, 10, 2, 0, pinned=True)
    mine = [_facts(i, live=5, created=i) for i in range(2, 5)]
    theirs = [Chunk(i, b"a" * 16, 1000, 10, 5, i, tenant=b"t" * 8) for i in range(5, 8)]
    chunks = [pinned, *mine, *theirs]
    assert pinned not in policy.rewrite_candidates(chunks, min_live=0.9)
    groups = policy.merge_groups(chunks, target_bytes=100_000)
    assert sorted(sorted(c.chunk_id for c in g) for g in groups) == [
        [2, 3, 4], [5, 6, 7],
    ]  # fmt: skip
