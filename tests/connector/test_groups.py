"""KV cache groups (npukv_store.connector.groups): the block rules of hybrid
models, against brute-force oracles written from vLLM's own definitions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npukv_store.connector.groups import KVGroup, blocks_to_save, classify, hit_end
from npukv_store.connector.spec_classes import SPEC_CLASSES
from npukv_store.errors import UnsupportedSetup

BS = 4


def sliding(tail_tokens: int, index: int = 1) -> KVGroup:
    return KVGroup(index, "sliding", ("layer",), tail_tokens)


def vllm_first_kept_block(end: int, window: int, extra: int = 0) -> int:
    """SlidingWindowManager: after ``end`` blocks of tokens are computed, the
    blocks before get_num_skipped_tokens(end * BS) // BS are null."""
    skipped = max(0, end * BS - window + 1 - extra)
    return skipped // BS


@given(end=st.integers(0, 200), window=st.integers(1, 64), extra=st.integers(0, 8))
def test_tail_start_is_the_first_block_vllm_keeps(end, window, extra):
    group = sliding(window - 1 + extra)
    assert group.tail_start(end, BS) == vllm_first_kept_block(end, window, extra)
    assert KVGroup(0, "full", ("x",)).tail_start(end, BS) == 0


@settings(max_examples=300)
@given(
    local=st.integers(0, 12),
    span=st.integers(0, 30),
    tails=st.lists(st.integers(0, 20), min_size=0, max_size=3),
    data=st.data(),
)
def test_hit_end_is_the_longest_end_with_every_tail_stored(local, span, tails, data):
    upper = local + span
    present = []
    for i, tail in enumerate(tails):
        stored = data.draw(st.lists(st.booleans(), min_size=span, max_size=span))
        present.append((sliding(tail, i + 1), stored))

    def servable(end: int) -> bool:  # brute force: every needed block stored
        return all(
            stored[b - local]
            for group, stored in present
            for b in range(max(local, group.tail_start(end, BS)), end)
        )

    ends = [e for e in range(local + 1, upper + 1) if servable(e)]
    expected = max(ends, default=local)
    assert hit_end(local, upper, BS, present) == expected


def test_hit_end_without_sliding_groups_is_the_full_groups_end():
    assert hit_end(2, 9, BS, []) == 9
    assert hit_end(9, 9, BS, []) == 9


@given(
    start=st.integers(0, 20),
    span=st.integers(0, 20),
    tail=st.integers(0, 16),
    ends=st.sets(st.integers(0, 45), max_size=4),
)
def test_blocks_to_save_keeps_exactly_the_tails_of_the_ends(start, span, tail, ends):
    stop = start + span
    group = sliding(tail)
    kept = blocks_to_save(group, start, stop, BS, tails_only=True, ends=ends)
    needed = {b for end in ends for b in range(group.tail_start(end, BS), end)} & set(
        range(start, stop)
    )
    assert kept == sorted(needed)
    everything = list(range(start, stop))
    assert blocks_to_save(group, start, stop, BS, tails_only=False, ends=ends) == (
        everything
    )
    full = KVGroup(0, "full", ("x",))
    assert blocks_to_save(full, start, stop, BS, tails_only=True, ends=ends) == (
        everything
    )


def test_a_saved_tail_serves_the_hit_at_its_end():
    """What a tails-only save keeps at an end is what hit_end needs there."""
    group = sliding(6)  # window 7 tokens: a hit at block 10 needs blocks 8, 9
    kept = blocks_to_save(group, 0, 12, BS, tails_only=True, ends={10})
    assert kept == [8, 9]
    stored = [b in kept for b in range(12)]
    assert hit_end(0, 12, BS, [(group, stored)]) == 10
    assert hit_end(0, 9, BS, [(group, stored[:9])]) == 0


@pytest.mark.parametrize(
    ("spec_class", "kind"),
    [
        ("FullAttentionSpec", "full"),
        ("MLAAttentionSpec", "full"),
        ("SlidingWindowSpec", "sliding"),
        ("SlidingWindowMLASpec", "sliding"),
        ("MambaSpec", "state"),
    ],
)
def test_classify_serves_attention_groups(spec_class, kind):
    assert classify(spec_class, 0, ["model.layers.0.self_attn.attn"]) == kind


@pytest.mark.parametrize(
    "spec_class", ["RSWASpec", "ChunkedLocalAttentionSpec", "CrossAttentionSpec"]
)
def test_classify_refuses_other_groups_by_name(spec_class):
    with pytest.raises(UnsupportedSetup, match=f"group 2 is {spec_class}") as info:
        classify(spec_class, 2, ["model.layers.0.linear_attn", "model.layers.1.x"])
    assert "model.layers.0.linear_attn" in str(info.value)
    assert SPEC_CLASSES[spec_class].why in str(info.value)


def test_classify_refuses_a_class_it_has_not_checked():
    with pytest.raises(UnsupportedSetup, match="has not checked") as info:
        classify("FancyNewSpec", 1, ["model.layers.3.attn"])
    assert "group 1 is FancyNewSpec" in str(info.value)
    assert "model.layers.3.attn" in str(info.value)
