"""The hit search: how far beyond vLLM's own prefix-cache hit the stored
blocks of a request reach.

Runs in: the EngineCore process, on the scheduler's thread.

    find_hit() - end of the longest hit: every full-attention group (every
                 rank) stores the prefix, locally or, where the local prefix
                 ends first, in the remote tier; every sliding-window group
                 the tail its window needs before the hit's end
"""

from __future__ import annotations

from collections.abc import Sequence

from npukv_store.connector.groups import KVGroup, hit_end
from npukv_store.connector.scheduler.keys import Keys, RequestState
from npukv_store.connector.scheduler.remote_lookup import RemoteLookup
from npukv_store.store.store import KVStore


def find_hit(
    state: RequestState,
    keys: Keys,
    local: int,
    max_blocks: int,
    *,
    store: KVStore,
    remote: RemoteLookup | None,
    groups: Sequence[KVGroup],
    fingerprints: list[list[bytes]],
    block_size: int,
) -> int | None:
    """End of the longest hit beyond ``local`` blocks in ``keys`` (each
    namespace's first ``max_blocks``); sets ``state.stored_full`` and
    ``state.remote_from``. None: the remote tier has not answered yet."""
    upper = max_blocks
    for rank_keys in keys:
        for group, chain in zip(groups, rank_keys, strict=True):
            if group.kind == "full" and upper > local:
                upper = min(upper, store.lookup(chain[:upper]))
    state.stored_full = state.remote_from = upper
    sliding = [g for g in groups if g.kind == "sliding"]
    if remote is not None and not sliding and upper < max_blocks:
        more = remote.extend(
            state.request.request_id,
            [
                (prints[g.index], rank_keys[g.index][upper:max_blocks])
                for rank_keys, prints in zip(keys, fingerprints, strict=True)
                for g in groups
            ],
        )
        if more is None:
            return None
        state.stored_full = upper = upper + more
    if upper <= local or not sliding:
        return upper
    present = []
    for group in sliding:
        stored = [True] * (upper - local)
        for rank_keys in keys:
            found = store.present(rank_keys[group.index][local:upper])
            stored = [a and b for a, b in zip(stored, found, strict=True)]
        present.append((group, stored))
    return hit_end(local, upper, block_size, present)
