"""The parents a save names (docs/decisions/0070): a chain's runs carry the
key of the block before each run, so its chunk goes below its parent in the
LRU; a save that is not a chain (a sliding-window group's tails, a state
group's boundaries) names none, since the store refuses a chunk whose given
parent is gone (it failed Gemma 3's sliding tails end to end)."""

from __future__ import annotations

from npukv_store.connector.metadata import slice_parents
from npukv_store.connector.scheduler.keys import transfer


def _keys(n: int, ranks: int = 2) -> list[list[list[bytes]]]:
    return [[[bytes([r, i]) * 8 for i in range(n)]] for r in range(ranks)]


def test_a_chains_runs_carry_their_parents_per_rank():
    keys = _keys(10)
    rows = [0, 1, 2, 6, 7]
    save = transfer("r", 0, list(range(1, 11)), rows, keys)
    for rank in range(2):
        chain = keys[rank][0]
        assert save.row_parents(rank) == [b"", None, None, chain[5], None]
        own = [chain[i] for i in rows]
        # one chunk of all five: its parents are where each run starts
        assert slice_parents(own, save.row_parents(rank), 0, 5) == [chain[5]]
        # a chunk cut inside a run: the block before it is its parent
        assert slice_parents(own, save.row_parents(rank), 1, 3) == [chain[0]]
        assert slice_parents(own, save.row_parents(rank), 3, 5) == [chain[5]]


def test_a_save_that_is_not_a_chain_names_no_parent():
    keys = _keys(10)
    save = transfer("r", 0, list(range(1, 11)), [3, 4, 8], keys, chained=False)
    assert save.parents_by_rank == []
    assert save.row_parents(0) == [None, None, None]
