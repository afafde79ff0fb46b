"""The hit search: how far beyond vLLM's own prefix-cache hit the stored
blocks of a request reach.

Runs in: the EngineCore process, on the scheduler's thread.

    find_hit() - end of the longest hit: every full-attention group (every
                 rank) stores the prefix, locally or, where the local prefix
                 ends first, in the remote tier; every sliding-window group
                 the tail its window needs before the hit's end; every Mamba
                 (state) group the state at the hit's end

A request's first search is its only one: vLLM asks again for a request it
could not schedule (a retry), and the answer is reused without a lookup. A
block evicted since then fails to load and is recomputed (docs/decisions/0033);
blocks stored since then are not found by that request (docs/decisions/0061).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from npukv_store.connector.groups import KVGroup, hit_end
from npukv_store.connector.scheduler.keys import KeyChains, RequestState, StoredPrefix
from npukv_store.connector.scheduler.lookups import stored_prefix
from npukv_store.connector.scheduler.remote_lookup import RemoteLookup
from npukv_store.store.store import KVStore


def find_hit(
    state: RequestState,
    chains: KeyChains,
    local: int,
    max_blocks: int,
    *,
    store: KVStore,
    remote: RemoteLookup | None,
    groups: Sequence[KVGroup],
) -> int | None:
    """End of the longest hit beyond ``local`` blocks of the first
    ``max_blocks``; sets ``state.stored_full`` and ``state.remote_from``.
    None: the remote tier has not answered yet."""
    stored = state.stored
    if stored is None or stored.max_blocks != max_blocks:
        stored = _stored(state, chains, local, max_blocks, store, remote, groups)
        if stored is None:
            return None
        state.stored = stored
    state.remote_from, state.stored_full = stored.local_end, stored.full_end
    upper = stored.full_end
    tails = [g for g in groups if g.kind != "full"]  # sliding and state groups
    if upper <= local or not tails:
        return upper
    if stored.local == local:
        return stored.found
    present = []
    for group in tails:
        stored_rows = [True] * (upper - local)
        for rank in range(len(chains.fingerprints)):
            keys = chains.rank_keys(state, rank, group.index, local, upper)
            found = store.present(keys)
            stored_rows = [a and b for a, b in zip(stored_rows, found, strict=True)]
        present.append((group, stored_rows))
    found_end = hit_end(local, upper, chains.block_size, present)
    state.stored = replace(stored, local=local, found=found_end)
    return found_end


def _stored(
    state: RequestState,
    chains: KeyChains,
    local: int,
    max_blocks: int,
    store: KVStore,
    remote: RemoteLookup | None,
    groups: Sequence[KVGroup],
) -> StoredPrefix | None:
    """How far every full-attention namespace stores the request's first
    ``max_blocks`` blocks, locally and then remotely."""
    chains.links(state, max_blocks)
    upper = max_blocks
    for group in groups:
        if group.kind == "full" and upper > 0:  # the answer holds for any local
            upper = stored_prefix(store, chains, state, group.index, upper)
    local_end = upper
    tails = any(g.kind != "full" for g in groups)
    if remote is not None and not tails and upper < max_blocks:
        more = remote.extend(
            state.request.request_id,
            [
                (
                    chains.fingerprints[rank][g.index],
                    chains.rank_keys(state, rank, g.index, upper, max_blocks),
                )
                for rank in range(len(chains.fingerprints))
                for g in groups
            ],
        )
        if more is None:
            return None
        upper += more
    return StoredPrefix(max_blocks, local_end, upper)
