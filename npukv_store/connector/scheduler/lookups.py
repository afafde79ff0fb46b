"""How far every TP rank of a KV cache group stores a request's chain,
without looking up every rank's every key.

Runs in: the EngineCore process, on the scheduler's thread.

    stored_prefix() - leading blocks of a group that every rank stores

The root rank (rank 0: its keys are the chain's links) is looked up key by key
and located: which chunk and row holds each block. Its blocks fall into runs,
consecutive rows of one chunk, one per save that wrote them. The other ranks
saved the same blocks in the same transfers (one per step, every rank's keys
in it), so their rows form the same runs: for each other rank, the first and
the last block of every run are located, and a run counts as stored when both
are in one chunk the run's length apart. Eviction takes a chunk's rows
together, so that is every row of the run unless that rank's save of the run
was split or deduplicated otherwise; then, and where a run's ends are
missing, the rank's keys from that run on are looked up one by one. What
remains in doubt (a row whose home is another chunk that was evicted) makes
the load fail and be recomputed, never serve wrong KV (docs/decisions/0033,
0061).

So a hit costs one lookup per block of rank 0 and two per save run of each
other rank, not one per block and rank: the cost no longer grows with TP.
The chunks found are touched (LRU) directly, not by keys the touch flush
would have to look up again, in chain order: parents first, so a parent stays
newer than its children (docs/decisions/0070).
"""

from __future__ import annotations

from collections.abc import Iterable

from npukv_store.connector.scheduler.keys import KeyChains, RequestState
from npukv_store.store.store import KVStore

Location = tuple[int, int]  # (chunk id, row)


def stored_prefix(
    store: KVStore,
    chains: KeyChains,
    state: RequestState,
    group: int,
    upper: int,
) -> int:
    """Leading blocks of ``group`` (of the first ``upper``) that every rank
    stores. The group's chain must reach ``upper``."""
    index = store.index
    links = state.links[group][:upper]
    if store.admitter.note_asked(links):  # auto's shadow sees every request
        store.touches.wake()
    count = index.lookup_prefix(links)
    located = index.locate(links[:count]) if count else []
    for i, loc in enumerate(located):
        if loc is None:  # evicted between the two reads
            count = i
            break
    locations: list[Location] = located[:count]  # type: ignore[assignment]
    store.counters.add(lookups=1, hit_blocks=count, lookup_blocks=len(links))
    _touch(store, dict.fromkeys(chunk_id for chunk_id, _ in locations))
    runs = _runs(locations)
    for rank in range(len(chains.fingerprints)):
        if count and not chains.is_root(rank, group):
            count = _rank_prefix(store, chains, state, rank, group, runs, count)
    return count


def _runs(locations: list[Location]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each run of consecutive rows of one chunk."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(locations) + 1):
        if i == len(locations) or locations[i] != (
            locations[i - 1][0],
            locations[i - 1][1] + 1,
        ):
            runs.append((start, i))
            start = i
    return runs


def _rank_prefix(
    store: KVStore,
    chains: KeyChains,
    state: RequestState,
    rank: int,
    group: int,
    runs: list[tuple[int, int]],
    count: int,
) -> int:
    """How many of the first ``count`` blocks ``rank`` stores too."""
    runs = [(start, min(stop, count)) for start, stop in runs if start < count]
    ends = [i for start, stop in runs for i in (start, stop - 1)]
    keys = [chains.key_at(state, rank, group, i) for i in ends]
    found = store.index.locate(keys)
    hits = sum(loc is not None for loc in found)
    store.counters.add(lookups=1, hit_blocks=hits, lookup_blocks=len(keys))
    chunks: dict[int, None] = {}  # chain order
    for n, (start, stop) in enumerate(runs):
        first, last = found[2 * n], found[2 * n + 1]
        if (
            first is not None
            and last is not None
            and first[0] == last[0]
            and last[1] - first[1] == stop - 1 - start
        ):
            chunks[first[0]] = None
            continue
        _touch(store, chunks)
        return start + _exact(store, chains, state, rank, group, start, count)
    _touch(store, chunks)
    return count


def _exact(
    store: KVStore,
    chains: KeyChains,
    state: RequestState,
    rank: int,
    group: int,
    start: int,
    stop: int,
) -> int:
    """Leading blocks of ``[start, stop)`` the rank stores, key by key."""
    keys = chains.rank_keys(state, rank, group, start, stop)
    found = store.index.lookup_prefix(keys)
    store.counters.add(lookups=1, hit_blocks=found, lookup_blocks=len(keys))
    if found:
        store.touches.note_keys(keys[:found])
    return found


def _touch(store: KVStore, chunk_ids: Iterable[int]) -> None:
    for chunk_id in chunk_ids:
        store.touches.note_chunk(chunk_id)
