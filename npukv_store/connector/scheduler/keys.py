"""What the scheduler remembers of a request, and its block keys.

Runs in: the EngineCore process, on the scheduler's thread.

    RequestState - one request's state between the scheduler's hooks
    KeyChains    - a request's chain per KV cache group, extended as the
                   request grows, and each namespace's keys derived from it
                   where they are needed
    transfer()   - some blocks of one KV cache group of a request, with every
                   rank's keys: a load or a save of the step's metadata

Keys are our own keyed chains (npukv_store.hashing): one chain per KV cache
group, rooted at its TP rank 0's namespace, whose links are rank 0's keys; the
other ranks' keys are derived from the links (docs/decisions/0061), so the
tokens are hashed once per group whatever the TP size. Besides the tokens, a
block's key covers what changes its KV as vLLM's prefix cache sees it (LoRA,
multimodal inputs, cache salt, prompt embeddings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from npukv_store.connector.metadata import NO_PARENT, BlockTransfer, pack_keys
from npukv_store.connector.scheduler.load_policy import Decision
from npukv_store.connector.vllm_api import lora_identity
from npukv_store.hashing import chain_links, rank_keys
from npukv_store.keying import DEFAULT_TENANT

Keys = list[list[list[bytes]]]  # [rank][group] -> one key per full block


@dataclass(frozen=True, slots=True)
class StoredPrefix:
    """What a lookup found for a request of ``max_blocks`` full blocks,
    reused by the scheduler's later calls for the same request (retries)."""

    max_blocks: int
    local_end: int  # every full-attention namespace stores [0, local_end)
    full_end: int  # with the remote tier's part
    local: int = -1  # the local hit the sliding-window part was found for
    found: int = 0  # the hit's end for that local hit


@dataclass(slots=True)
class RequestState:
    request: Any
    links: list[list[bytes]]  # [group] -> the chain of its full blocks
    keys: Keys  # [rank][group] -> keys derived so far (the links at the root)
    next_mm_index: int = 0
    local_tokens: int = 0  # the block-aligned local hit passed to match()
    found_blocks: int = 0  # end of the stored prefix match() found
    hit_blocks: int = 0  # end of the hit it claims (the load policy's part)
    decision: Decision | None = None  # not yet counted in the stats
    stored_full: int = 0  # leading blocks every full-attention group stores
    remote_from: int = 0  # blocks from here to stored_full are remote only
    saved_blocks: int = 0  # blocks [0, saved_blocks) are stored, loaded or queued
    saved_any: bool = False
    counted: bool = False  # its lookup is in the stats
    extras: list[bytes] = field(default_factory=list)
    stored: StoredPrefix | None = None  # the first lookup's answer
    cached_head: tuple[int, int, int] | None = None  # (local, found, blocks)
    tenant: bytes = DEFAULT_TENANT  # of its cache salt (docs/decisions/0067)


class KeyChains:
    """The key chains of an engine's namespaces: ``roots[group]`` seeds each
    group's chain of ``block_size``-token blocks, keyed with ``chain_key``
    (the store's key domain, npukv_store.keying; set once the store is open);
    ``fingerprints[rank][group]`` names each namespace."""

    def __init__(
        self,
        block_size: int,
        fingerprints: list[list[bytes]],
        roots: list[bytes],
        chain_key: bytes | None = None,
    ) -> None:
        self.block_size = block_size
        self.fingerprints = fingerprints
        self.roots = roots
        self.chain_key = chain_key

    def is_root(self, rank: int, group: int) -> bool:
        """Whether the namespace's keys are its group's chain links."""
        return self.fingerprints[rank][group] == self.roots[group]

    def new_state(self, request: Any) -> RequestState:
        """A request's state, with empty chains."""
        links: list[list[bytes]] = [[] for _ in self.roots]
        keys = [
            [links[g] if self.is_root(r, g) else [] for g in range(len(self.roots))]
            for r in range(len(self.fingerprints))
        ]
        return RequestState(request, links, keys)

    def links(self, state: RequestState, num_blocks: int) -> list[list[bytes]]:
        """Each group's chain, extended to at least ``num_blocks`` blocks
        (the lists themselves: slice them)."""
        have = len(state.links[0])
        if num_blocks > have:
            bs = self.block_size
            tokens = list(state.request.all_token_ids[have * bs : num_blocks * bs])
            extra = self._extras(state, have, num_blocks)
            for chain, root in zip(state.links, self.roots, strict=True):
                parent = chain[-1] if chain else None
                chain += chain_links(
                    tokens, bs, root, extra, parent, key=self._chain_key()
                )
        return state.links

    def rank_keys(
        self, state: RequestState, rank: int, group: int, start: int, stop: int
    ) -> list[bytes]:
        """The namespace's keys of blocks ``[start, stop)`` (the chain must
        reach ``stop``). Derived keys are kept where they continue the kept
        prefix; keys far beyond it are derived and not kept."""
        kept = state.keys[rank][group]
        links = state.links[group]
        if stop <= len(kept) or self.is_root(rank, group):
            return kept[start:stop]
        derive = self._derive(rank, group)
        if start <= len(kept):
            kept += derive(links[len(kept) : stop])
            return kept[start:stop]
        return derive(links[start:stop])

    def key_at(self, state: RequestState, rank: int, group: int, i: int) -> bytes:
        kept = state.keys[rank][group]
        if i < len(kept):
            return kept[i]
        return self._derive(rank, group)(state.links[group][i : i + 1])[0]

    def keys(self, state: RequestState, num_blocks: int) -> Keys:
        """Each namespace's keys of the first ``num_blocks`` full blocks."""
        self.links(state, num_blocks)
        return [
            [
                self.rank_keys(state, rank, group, 0, num_blocks)
                for group in range(len(self.roots))
            ]
            for rank in range(len(self.fingerprints))
        ]

    def _chain_key(self) -> bytes:
        assert self.chain_key is not None, "KeyChains used before the store opened"
        return self.chain_key

    def _derive(self, rank: int, group: int) -> Callable[[list[bytes]], list[bytes]]:
        fingerprint, root = self.fingerprints[rank][group], self.roots[group]
        key = self._chain_key()
        return lambda links: rank_keys(links, fingerprint, root, key=key)

    def _extras(self, state: RequestState, start: int, stop: int) -> list[bytes]:
        """Per block: what besides the tokens changes its KV (LoRA, multimodal
        inputs, cache salt, prompt embeddings), as vLLM's prefix cache sees it."""
        request = state.request
        if not (
            request.lora_request
            or request.mm_features
            or request.cache_salt
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return [b""] * (stop - start)
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        # The adapter by name and path on every vLLM (< 0.32 hashes the name
        # only): the store outlives an adapter re-pointed under its name.
        lora = lora_identity(request.lora_request) if request.lora_request else ""
        salt = request.cache_salt or ""
        bs = self.block_size
        while len(state.extras) < stop:
            index = len(state.extras)
            extra, state.next_mm_index = generate_block_hash_extra_keys(
                request, index * bs, (index + 1) * bs, state.next_mm_index
            )
            fields = [(b"lora", lora.encode())]
            if index == 0:  # as in vLLM, the salt enters block 0; the chain carries it
                fields.append((b"salt", salt.encode()))
            fields.append((b"vllm", encode_extra_keys(extra or ())))
            state.extras.append(tagged(fields))
        return state.extras[start:stop]


def tagged(fields: list[tuple[bytes, bytes]]) -> bytes:
    """Fields as ``tag len(u32 LE) value`` each: no two different lists of
    fields encode alike (a LoRA named "X" and a cache salt "X" differ)."""
    return b"".join(
        tag + len(value).to_bytes(4, "little") + value for tag, value in fields
    )


def encode_extra_keys(extra: tuple[Any, ...]) -> bytes:
    """vLLM's per-block extra keys (strings, ints, bytes, nested tuples),
    each tagged with its type and length: never a ``repr`` that could
    truncate or confuse types."""
    fields: list[tuple[bytes, bytes]] = []
    for item in extra:
        if isinstance(item, bytes | bytearray):
            fields.append((b"b", bytes(item)))
        elif isinstance(item, str):
            fields.append((b"s", item.encode()))
        elif isinstance(item, bool | int):
            fields.append((b"i", str(int(item)).encode()))
        elif isinstance(item, tuple | list):
            fields.append((b"t", encode_extra_keys(tuple(item))))
        else:  # a hash object vLLM may add later: its stable repr, tagged apart
            fields.append((b"r", repr(item).encode()))
    return tagged(fields)


def transfer(
    req_id: str,
    group: int,
    block_ids: list[int],
    rows: list[int],
    keys: Keys,
    *,
    asynchronous: bool = False,
    remote: bool = False,
    tenant: bytes = DEFAULT_TENANT,
    chained: bool = True,
) -> BlockTransfer:
    """Blocks ``rows`` of one group of a request, with every rank's keys;
    ``chained``: a save of a prefix-closed chain, whose runs carry their
    parents' keys (0070). A sliding-window group's tails and a state group's
    boundaries are saved without the blocks before them: no parent (the
    store refuses a chunk whose given parent is gone)."""
    return BlockTransfer(
        req_id,
        [block_ids[i] for i in rows],
        [pack_keys([rank[group][i] for i in rows]) for rank in keys],
        group=group,
        asynchronous=asynchronous,
        remote=remote,
        rows=list(rows),
        tenant=tenant,
        parents_by_rank=[
            pack_keys([
                rank[group][i - 1] if i > 0 else NO_PARENT
                for j, i in enumerate(rows)
                if j == 0 or rows[j - 1] != i - 1
            ])
            for rank in keys
        ]
        if chained
        else [],
    )  # fmt: skip
