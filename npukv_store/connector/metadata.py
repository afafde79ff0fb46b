"""What the scheduler-side connector tells the workers each step, and back.

Runs in: built in the EngineCore process, pickled to every Worker process.

Keys travel per TP rank as one ``bytes`` of concatenated 16-byte keys: the
metadata is pickled every step, and a flat blob costs far less than a list of
small bytes objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from npukv_store.connector.vllm_api import WorkerMetadataBase
from npukv_store.hashing import KEY_BYTES
from npukv_store.keying import DEFAULT_TENANT


def pack_keys(keys: list[bytes]) -> bytes:
    return b"".join(keys)


def unpack_keys(blob: bytes) -> list[bytes]:
    return [blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request and KV cache group to load or save:
    ``block_ids[i]`` holds the block keyed ``keys_by_rank[rank][i]``."""

    req_id: str
    block_ids: list[int]
    keys_by_rank: list[bytes]  # per TP rank (one entry when rank-independent)
    group: int = 0  # the KV cache group (its layers and namespace)
    #: a load the workers report through finished/failed_recving, off the
    #: forward (hybrid models), rather than before the step's forward
    asynchronous: bool = False
    #: blocks the remote tier holds (the local store does not): the workers
    #: read them from it (npukv_store.remote), before the local ones
    remote: bool = False
    #: the blocks' positions in the request (KV events name them by vLLM's
    #: block hashes); not needed by the workers
    rows: list[int] = field(default_factory=list)
    #: whose blocks they are (a save's chunk holds one tenant's blocks: the
    #: keyed digest of the request's cache salt, docs/decisions/0067)
    tenant: bytes = DEFAULT_TENANT
    #: per TP rank, the key of the block before each run of consecutive
    #: ``rows`` (16 zero bytes where a run starts its chain): a save's chunk
    #: goes below them in the LRU, so eviction never strands it (docs/
    #: decisions/0070)
    parents_by_rank: list[bytes] = field(default_factory=list)

    def keys(self, rank: int) -> list[bytes]:
        blob = self.keys_by_rank[rank if len(self.keys_by_rank) > 1 else 0]
        return unpack_keys(blob)

    def row_parents(self, rank: int) -> list[bytes | None]:
        """Per block: the key of its parent where a run of ``rows`` starts
        (b"" where it starts its chain), None where the block before it in
        this transfer is its parent."""
        out: list[bytes | None] = [None] * len(self.block_ids)
        if not self.parents_by_rank:
            return out
        blob = self.parents_by_rank[rank if len(self.parents_by_rank) > 1 else 0]
        parents = iter(unpack_keys(blob))
        for j, row in enumerate(self.rows):
            if j == 0 or self.rows[j - 1] != row - 1:
                key = next(parents, NO_PARENT)
                out[j] = b"" if key == NO_PARENT else key
        return out


#: a run that starts its chain has no parent
NO_PARENT = bytes(KEY_BYTES)


def slice_parents(
    keys: list[bytes], row_parents: list[bytes | None], start: int, stop: int
) -> list[bytes]:
    """The parent keys of the chunk of ``keys[start:stop]`` (a save batch
    of several transfers: :meth:`BlockTransfer.row_parents` concatenated)."""
    out = []
    for i in range(start, stop):
        parent = row_parents[i]
        if parent is None and i == start and i > 0:
            parent = keys[i - 1]  # a run cut by the chunk size
        if parent:
            out.append(parent)
    return out


def concat_transfers(
    transfers: list[BlockTransfer], rank: int
) -> tuple[list[bytes], list[int]]:
    """Rank ``rank``'s keys and the block ids of ``transfers``, in order."""
    keys: list[bytes] = []
    block_ids: list[int] = []
    for transfer in transfers:
        keys += transfer.keys(rank)
        block_ids += transfer.block_ids
    return keys, block_ids


@dataclass
class NPUKVMetadata(KVConnectorMetadata):
    """One step's work: loads before/while the forward runs, saves after."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    #: requests that finished and whose blocks the scheduler keeps allocated
    #: until the workers report them (get_finished) after their saves' copies
    held_req_ids: list[str] = field(default_factory=list)
    #: asynchronous loads vLLM waits for but the scheduler could not plan: the
    #: workers report them received and failed, so vLLM recomputes them
    #: instead of waiting for ever
    failed_loads: list[str] = field(default_factory=list)
    #: tokens the step computes (vLLM's total_num_scheduled_tokens): with the
    #: step's compute time, what the load policy prices recompute by
    num_scheduled_tokens: int = 0
    #: the most tokens any one request computes in the step (its query
    #: length); 0 when not known. vllm-ascend's MLA skips wait_for_layer_load
    #: when every request is within the decode threshold (ascend_rules)
    max_request_tokens: int = 0

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.held_req_ids or self.failed_loads)


@dataclass
class NPUKVWorkerMetadata(WorkerMetadataBase):  # type: ignore[misc]
    """Worker -> scheduler, each step: whether any worker turned itself off (a
    layout it cannot copy), so the scheduler stops promising hits; and the
    costs measured since the last step, for the load policy."""

    disabled_reason: str = ""
    #: per finished load: (seconds, bytes from the page cache, bytes from disk)
    load_samples: list[tuple[float, int, int]] = field(default_factory=list)
    #: per step that loaded nothing: (compute seconds, tokens computed)
    step_samples: list[tuple[float, int]] = field(default_factory=list)

    def aggregate(self, other: Any) -> NPUKVWorkerMetadata:
        reason = getattr(other, "disabled_reason", "")
        return NPUKVWorkerMetadata(
            self.disabled_reason or reason,
            self.load_samples + list(getattr(other, "load_samples", [])),
            self.step_samples + list(getattr(other, "step_samples", [])),
        )
