"""What the scheduler remembers of a request, and its block keys.

Runs in: the EngineCore process, on the scheduler's thread.

    RequestState - one request's state between the scheduler's hooks
    KeyChains    - each namespace's key chain of a request's full blocks,
                   extended as the request grows
    transfer()   - some blocks of one KV cache group of a request, with every
                   rank's keys: a load or a save of the step's metadata

Keys are our own xxh3 chains (npukv_store.hashing), one chain per namespace:
per TP rank and KV cache group. Besides the tokens, a block's key covers what
changes its KV as vLLM's prefix cache sees it (LoRA, multimodal inputs, cache
salt, prompt embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from npukv_store.connector.metadata import BlockTransfer, pack_keys
from npukv_store.connector.scheduler.load_policy import Decision
from npukv_store.connector.vllm_api import lora_identity
from npukv_store.hashing import chain_hashes

Keys = list[list[list[bytes]]]  # [rank][group] -> one key per full block


@dataclass(slots=True)
class RequestState:
    request: Any
    keys: Keys
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


class KeyChains:
    """The key chains of an engine's namespaces: ``fingerprints[rank][group]``
    seeds each chain of ``block_size``-token blocks, keyed with ``chain_key``
    (the store's key domain, npukv_store.keying; set once the store is open)."""

    def __init__(
        self,
        block_size: int,
        fingerprints: list[list[bytes]],
        chain_key: bytes | None = None,
    ) -> None:
        self.block_size = block_size
        self.fingerprints = fingerprints
        self.chain_key = chain_key

    def new_state(self, request: Any) -> RequestState:
        """A request's state, with an empty chain per namespace."""
        return RequestState(request, [[[] for _ in rank] for rank in self.fingerprints])

    def keys(self, state: RequestState, num_blocks: int) -> Keys:
        """Each namespace's keys of the first ``num_blocks`` full blocks."""
        have = len(state.keys[0][0])
        if num_blocks > have:
            bs = self.block_size
            request = state.request
            tokens = list(request.all_token_ids[have * bs : num_blocks * bs])
            extra = self._extras(state, have, num_blocks)
            chain_key = self.chain_key
            assert chain_key is not None, "KeyChains used before the store opened"
            for rank_keys, rank_prints in zip(
                state.keys, self.fingerprints, strict=True
            ):
                for chain, fingerprint in zip(rank_keys, rank_prints, strict=True):
                    parent = chain[-1] if chain else None
                    chain += chain_hashes(
                        tokens, bs, fingerprint, extra, parent=parent, key=chain_key
                    )
        return [[chain[:num_blocks] for chain in rank] for rank in state.keys]

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
) -> BlockTransfer:
    """Blocks ``rows`` of one group of a request, with every rank's keys."""
    return BlockTransfer(
        req_id,
        [block_ids[i] for i in rows],
        [pack_keys([rank[group][i] for i in rows]) for rank in keys],
        group=group,
        asynchronous=asynchronous,
        remote=remote,
    )
