"""KV cache groups: which blocks of each group a hit needs and which a save keeps.

Runs in: EngineCore and every Worker. Pure functions over block indices: no
vLLM import, no I/O, so the rules are tested on their own.

vLLM's hybrid KV cache manager (HMA) gives each group of layers its own block
table. Three kinds of group are served:

    full     a hit ending at block ``end`` needs every block before it
    sliding  it needs only the blocks holding tokens
             ``[end*bs - window + 1 - extra_retained, end*bs)``: vLLM gives the
             request null blocks (id 0) below that and frees them as the window
             moves (SlidingWindowManager.get_num_skipped_tokens)
    state    a Mamba / linear-attention group in vLLM's align mode: it needs
             only block ``end - 1``, which holds the recurrent state after
             token ``end*bs - 1`` (MambaManager.get_num_skipped_tokens keeps
             one token: a tail of 1). Its blocks are never saved by position:
             vLLM rewrites and relocates a Mamba block table, so a state is
             saved only from the exact block vLLM hands over
             (docs/decisions/0065)

Which vLLM spec class is which kind, and why every other class (chunked
local attention, cross attention, ...) is refused,
is :mod:`.spec_classes`; ``classify`` checks every layer of a group against
it. vllm-ascend gives every MLA layer its own subclass,
``AscendMLAAttentionSpec``: served as MLA full attention in its plain form
and in DeepSeek-V3.2's sparse form (see ``ascend_mla_mismatch``).

    classify()        - a group's kind from vLLM's KV cache spec class
    ascend_mla_mismatch() - why an AscendMLAAttentionSpec is not a served form
    KVGroup           - one group: kind, layers, the tokens a hit must hold
    hit_end()         - the longest hit whose sliding tails are all stored
    blocks_to_save()  - which blocks of a step's range a group keeps
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from npukv_store.connector.spec_classes import (
    SPEC_CLASSES,
    GroupKind,
    field_mismatch,
)
from npukv_store.errors import UnsupportedSetup

#: vllm-ascend's spec for every MLA layer (core/kv_cache_interface.py:28 in
#: 0.23.0.post1); full attention (CompressAttentionManager) only when plain
ASCEND_MLA = "AscendMLAAttentionSpec"


def classify(
    spec_class: str,
    group_index: int,
    layer_names: Sequence[str],
    specs: Sequence[Any] = (),
) -> GroupKind:
    """The kind of a KV cache group whose spec is of class ``spec_class``.

    Args:
        specs: the group's spec objects (one per layer, or the group's one).
            Every one is checked: its class must be served, of the group's
            kind, and in its served form (:func:`.spec_classes.field_mismatch`;
            for ``AscendMLAAttentionSpec`` :func:`ascend_mla_mismatch`).

    Raises:
        UnsupportedSetup: a class refused by name (:data:`SPEC_CLASSES`, or
            none listed), or a served class in another form, named with the
            group and one of its layers, in one line.
    """
    first = layer_names[0] if layer_names else "no layers"
    where = (
        f"KV cache group {group_index} is {spec_class} ({len(layer_names)} "
        f"layer(s), e.g. {first})"
    )
    kind = _served_kind(spec_class, where)
    if spec_class == ASCEND_MLA and not specs:
        raise UnsupportedSetup(f"{where}, not a served MLA form: no spec given")
    per_layer = len(specs) == len(layer_names)
    names = layer_names if per_layer else [first] * len(specs)
    for name, spec in zip(names, specs, strict=True):
        own = type(spec).__name__
        here = where
        if own != spec_class:  # a per-layer group of several classes
            here = f"KV cache group {group_index} holds {own} (layer {name})"
            here += f" beside {spec_class}"
        own_kind = _served_kind(own, here)
        if own_kind != kind:
            raise UnsupportedSetup(
                f"{here}: layers of one group must be one kind, found "
                f"{own_kind} and {kind}"
            )
        if own == ASCEND_MLA:
            bad = ascend_mla_mismatch(spec)
            if bad:
                raise UnsupportedSetup(
                    f"{here}, not a served MLA form: {bad}; served: "
                    "compress_ratio 1 with the plain nope + rope page, or "
                    "DeepSeek-V3.2's sparse form (one indexer row per block)"
                )
        bad = field_mismatch(own, spec)
        if bad:
            raise UnsupportedSetup(f"{here}: {bad}")
    return kind


def _served_kind(spec_class: str, where: str) -> GroupKind:
    rule = SPEC_CLASSES.get(spec_class)
    if rule is None:
        raise UnsupportedSetup(
            f"{where}: a spec class this connector has not checked; expected "
            f"one of {', '.join(k for k, r in SPEC_CLASSES.items() if r.kind)} "
            "(docs/vllm.md lists every class and why)"
        )
    if rule.kind is None:
        raise UnsupportedSetup(f"{where}: {rule.why}")
    return rule.kind


def ascend_mla_mismatch(spec: Any) -> str:
    """Why an ``AscendMLAAttentionSpec`` is not a form served as MLA full
    attention, or "" when it is: one block of ``block_size`` tokens, each
    token's latent (nope) and rope vectors and nothing else, which is what
    the store keys and copies for vLLM's own MLAAttentionSpec; or the sparse
    form of DeepSeek-V3.2 (:func:`_sparse_mismatch`).

    Fields as in vllm-ascend 0.23.0.post1 (core/kv_cache_interface.py:27-121;
    ``compress_ratio`` is vLLM 0.23's MLAAttentionSpec field): absent ones
    take their plain defaults.
    """
    ratio = getattr(spec, "compress_ratio", 1)
    if ratio != 1:
        # a block of block_size tokens holds block_size / ratio compressed
        # states (DeepSeek V4): not one page per block of tokens
        return f"compress_ratio={ratio}, expected 1"
    sparse = getattr(spec, "sparse_head_dim", None)
    if sparse is not None:
        return _sparse_mismatch(spec, tuple(sparse))
    scale = getattr(spec, "scale_dim", 0) or 0
    if scale:
        return f"scale_dim={scale}, expected 0 (no quantization scales in the page)"
    itemsize = int(getattr(spec.dtype, "itemsize", 0))
    plain = (
        int(spec.block_size) * int(spec.num_kv_heads) * int(spec.head_size) * itemsize
    )
    page = int(spec.page_size_bytes)
    if page != plain:
        return (
            f"page_size_bytes={page}, expected {plain} (block_size x "
            "num_kv_heads x head_size x dtype size: the nope + rope page)"
        )
    return ""


def _sparse_mismatch(spec: Any, sparse: tuple[int, ...]) -> str:
    """DeepSeek-V3.2's sparse MLA on Ascend (SFA): each layer registers
    ``(nope, rope, indexer key[, indexer scale])`` (or, with SFA C8, the
    packed latent, the indexer key[, its scale]) for one block of
    ``block_size`` tokens, all of them a function of the prefix. Served: the
    page is the whole tuple, so a block's latent and indexer key are stored
    in one row and loaded together or not at all; the registration checks
    that the members' bytes per block add up to ``page_size_bytes``. Refused
    where the indexer is replicated over decode-context-parallel ranks
    (its rows are not one per block)."""
    if len(sparse) != 3:
        return f"sparse_head_dim={sparse}, expected (latent, rope, indexer) dims"
    replicas = getattr(spec, "sfa_dcp_replicated_indexer_size", 1)
    if replicas != 1:
        return f"sfa_dcp_replicated_indexer_size={replicas}, expected 1"
    return ""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group of the engine, as the connector serves it."""

    index: int
    kind: GroupKind
    layer_names: tuple[str, ...]
    #: sliding: tokens before a hit's end that the next token still attends to
    #: or vLLM still retains (window - 1 + extra_retained_tokens); state: 1
    #: (the last token's state); 0 for full
    tail_tokens: int = 0

    def tail_start(self, end: int, block_size: int) -> int:
        """First block a hit ending at block ``end`` needs in this group."""
        if self.kind == "full":
            return 0
        return max(0, end * block_size - self.tail_tokens) // block_size


def hit_end(
    local: int,
    upper: int,
    block_size: int,
    present: Sequence[tuple[KVGroup, Sequence[bool]]],
) -> int:
    """The largest ``end`` in ``(local, upper]`` such that every sliding or
    state group stores the blocks ``[max(local, tail_start(end)), end)``;
    ``local`` when there is none (no external hit).

    Args:
        local: blocks vLLM's own prefix cache already holds.
        upper: the hit end the full-attention groups allow (their longest
            stored prefix, capped below the last token).
        present: per sliding or state group, whether each block of ``[local, upper)``
            is stored (every TP rank's part).
    """
    if upper <= local:
        return local
    runs: list[tuple[KVGroup, list[int]]] = []
    for group, stored in present:
        assert len(stored) == upper - local
        run = [0] * (upper - local + 1)  # run[i]: stored blocks ending at local+i
        for i, here in enumerate(stored):
            run[i + 1] = run[i] + 1 if here else 0
        runs.append((group, run))
    for end in range(upper, local, -1):
        if all(
            run[end - local] >= end - max(local, group.tail_start(end, block_size))
            for group, run in runs
        ):
            return end
    return local


def blocks_to_save(
    group: KVGroup,
    start: int,
    stop: int,
    block_size: int,
    *,
    tails_only: bool,
    ends: Iterable[int],
) -> list[int]:
    """The blocks of ``[start, stop)`` that ``group`` saves this step.

    State groups save none here (their states come from vLLM's hand-offs,
    :meth:`.scheduler.save_plan.SavePlan.boundary_transfers`). Full groups,
    and sliding groups unless ``tails_only``, save them all. With
    ``tails_only`` a sliding group saves only the tails of the hit ends a later
    request is known to land on (``ends``: the prompt's end, the junction where
    its stored prefix stopped, each decode block's end): the bytes a hit needs,
    and no more.
    """
    if group.kind == "state":
        return []
    if group.kind == "full" or not tails_only:
        return list(range(start, stop))
    keep: set[int] = set()
    for end in ends:
        first = max(start, group.tail_start(end, block_size))
        keep.update(range(first, min(stop, end)))
    return sorted(keep)
